"""The driver of tiering_steps.py: one run of the trace through one manager.

``run_one`` builds the manager (shmtier/bench/managers.py) on a fresh temp directory,
``measure`` (also for a manager its caller built, e.g. bench/node_pool.py's replicas) freezes
the GC heap as vLLM's engine core does, and ``drive`` plays the OffloadingConnector's
scheduler half over the whole trace through the connector driver
(shmtier/connector_driver.py), one engine step at a time: admit waiting requests
(on_new_request, lookup scan, prepare_load + get_load_source), offer each running
request's next chunks to prepare_store (the rows then filled, standing in for the GPU
copy), on_request_finished, on_schedule_end; sleep out the step; complete last step's
jobs; has_pending_work, get_stats, take_events. Where vLLM 0.33's and 0.34's connectors
differ (the keys a job's completion gets, ``complete_store``'s arguments) the calls are
made as ``cfg.connector`` says (shmtier/bench/baseline.py), for every manager alike. A
waiting request that, with nothing else left, loses hits to the waiting requests' own
promotions ``cfg.self_eviction_scans`` lookup scans in a row (vLLM's LRU does that: see the
check in ``drive``) is given up as an aborted one (on_request_finished) and listed in the
figures' "abandoned". Every manager call is timed, wall and on-CPU (the driver's timed
regions, booked by ``_Figures``); the run's raw figures come back as a dict for
shmtier/bench/report.py. After the run the manager and its /dev/shm entries are removed
and its directory emptied, also on error; the emptied directories go when the process
exits (``retire_root``).
"""

from __future__ import annotations

import atexit
import gc
import os
import re
import resource
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from shmtier.bench import baseline
from shmtier.bench.common import DrivenRequest
from shmtier.bench.managers import MAKERS, TOKENS_PER_CHUNK, Mut, make_shmtier, sched_of, sweep_shm
from shmtier.bench.slow_steps import StepProbe
from shmtier.connector_driver import LOCK_WAIT, ConnectorDriver, Contract, Meter

TAG = f"bench-ts-{os.getpid()}-"
KINDS = (LOCK_WAIT, "on_new_request", "lookup", "prepare_load", "get_load_source",
         "prepare_store", "on_request_finished", "on_schedule_end", "complete_store",
         "complete_load", "has_pending_work", "get_stats", "take_events")
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Config:
    chunk_bytes: int
    cpu_bytes: int
    step_ms: float
    max_running: int
    batch: int
    workers: int
    dir: str
    worker_sched: str = "default"
    compression: str | None = None  # None: shmtier's default (``compression``)
    direct_io: bool | str | None = None  # None: the fs tier's default (``direct_io``)
    write_depth: int | None = None  # None: the fs tier's default
    drain_timeout_s: float = 60.0
    max_extra_steps: int = 20_000
    # a waiting request that loses hits to the waiting requests' own promotions this
    # many lookup scans in a row, nothing else left, is given up (``drive``, SELF_EVICTION)
    self_eviction_scans: int = 1000
    samples: int = 0  # >0: sample the fs tier's bytes on disk about this many times per run
    progress: object = None  # callable(run_fraction) called about every 2% of the trace
    # the connector whose calls are replayed (shmtier/bench/baseline.py); None: the one
    # baseline.load picked
    connector: object = None


def pool_index(key: bytes, n_pool: int) -> int:
    """The data-pool chunk a key's row is filled from: a function of the key alone, so a
    loaded row can be checked byte for byte against what its key's store wrote."""
    return int.from_bytes(key[16:20], "little") % n_pool


def verify_row(row: np.ndarray, key: bytes, data_pool: np.ndarray, payload: int) -> bool:
    """Whether an arena row holds exactly what the driver wrote for ``key``: the key's first
    16 bytes, then its data-pool chunk (every byte of the chunk)."""
    if row[:16].tobytes() != key[:16]:
        return False
    return bool(np.array_equal(row[16:payload], data_pool[pool_index(key, len(data_pool))][16:payload]))


def wrong_bytes(row: np.ndarray, key: bytes, data_pool: np.ndarray, payload: int) -> int:
    """How many of a row's first ``payload`` bytes differ from what the driver wrote for
    ``key`` (0 where ``verify_row`` holds)."""
    want = data_pool[pool_index(key, len(data_pool))][:payload].copy()
    want[:16] = np.frombuffer(key[:16], dtype=np.uint8)
    return int(np.count_nonzero(row[:payload] != want))


def make_data_pool(chunk_bytes: int, n: int, seed: int) -> np.ndarray:
    """``n`` chunks of bf16-like data: the high 16 bits of random-normal float32."""
    rng = np.random.default_rng(seed)
    f = rng.standard_normal(n * chunk_bytes // 2, dtype=np.float32)
    bf16 = (f.view(np.uint32) >> 16).astype(np.uint16)
    return bf16.view(np.uint8).reshape(n, chunk_bytes)


@dataclass(slots=True)
class _Req(DrivenRequest):
    """A trace request (``spec``) in the driver, with what the bench records of it."""

    deferrals: int = 0
    admitted: int = -1
    pending_since: dict = field(default_factory=dict)  # key -> (step, perf_counter)
    # the keys its last lookup scan was answered HIT for, if that scan ran with only
    # waiting requests left (``idle`` in drive); else None
    idle_hits: frozenset | None = None
    self_evictions: int = 0  # such scans in a row that lost a hit of the scan before
    # keys answered HIT after a RETRY/HIT_PENDING not for a store of the driver's own in
    # flight: promoted for this request from a tier below the CPU tier
    promoted: set = field(default_factory=set)


def _proc_cpu(pid: int) -> tuple[float, float] | None:
    """(user, kernel) CPU seconds of process ``pid`` so far, all its threads (``utime``,
    ``stime`` of /proc/<pid>/stat: the kernel splits the total by tick samples); None
    once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def _threads_cpu() -> dict:
    """Per live thread of this process: ``native_id -> (name, user s, kernel s)``
    (/proc/self/task/<tid>/stat; Python names, as the OS names every thread "python")."""
    out = {}
    for t in threading.enumerate():
        tid = t.native_id
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError, TypeError):
            continue
        out[tid] = (t.name, int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK)
    return out


def _threads_delta(before: dict, after: dict) -> dict:
    """CPU of this process's threads over the run by kind (the thread name without its
    numbers, e.g. "ThreadPoolExecutor-_"): ``{kind: {"user", "sys", "threads"}}``; a
    thread that ended within the run is missing (its CPU is in the process's total)."""
    out: dict[str, dict] = {}
    for tid, (name, user, sys_) in after.items():
        _, user0, sys0 = before.get(tid, (name, 0.0, 0.0))
        kind = re.sub(r"\d+", "", name)
        v = out.setdefault(kind, {"user": 0.0, "sys": 0.0, "threads": 0})
        v["user"] += user - user0
        v["sys"] += sys_ - sys0
        v["threads"] += 1
    return out


def _workers_cpu(mut: Mut, before: list, after: list) -> dict:
    """The tier workers' CPU over the run per process kind: ``{lane: {"user", "sys",
    "workers"}}`` (lanes of shmtier/shared/lanes.py: ``background``, ``promotion``)
    from ``_proc_cpu`` samples of ``mut.worker_pids`` (in slot order) before and after.
    A worker restarted in the run counts until it died (its successor is not sampled)."""
    from shmtier.shared.lanes import worker_lane

    n = len(mut.worker_pids)
    options = getattr(getattr(mut.pool, "config", None), "options", None)
    promotion = getattr(options, "promotion_workers", 0) or 0
    out: dict[str, dict] = {}
    for w, (a, b) in enumerate(zip(before, after)):
        lane = out.setdefault(worker_lane(w, n, promotion),
                              {"user": 0.0, "sys": 0.0, "workers": 0})
        lane["workers"] += 1
        if a is not None and b is not None:
            lane["user"] += b[0] - a[0]
            lane["sys"] += b[1] - a[1]
    return out


def _proc_status_mib(pid: int, field_: str = "RssAnon") -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_ + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _proc_rss_anon_mib(pid: int) -> float | None:
    return _proc_status_mib(pid, "RssAnon")


def _dir_bytes(root: str) -> int:
    size = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return size


class _Figures(Meter):
    """Books each timed region of the driver (shmtier/connector_driver.py) to the run's
    per-kind totals and to this step (``acc``: wall, CPU; ``step_kind``: wall per kind;
    ``step_kind_cpu``: CPU per kind);
    the probe brackets each region (its ``begin`` is this meter's)."""

    def __init__(self, probe: StepProbe):
        self.begin = probe.begin
        self._probe_end = probe.end
        self.ns = dict.fromkeys(KINDS, 0)  # wall ns inside the calls
        self.cpu_ns = dict.fromkeys(KINDS, 0)  # this thread's CPU ns around the calls
        self.calls = dict.fromkeys(KINDS, 0)
        self.acc = [0, 0]  # this step: wall ns, cpu ns
        self.step_kind = [0] * len(KINDS)  # this step: wall ns per kind
        self.step_kind_cpu = [0] * len(KINDS)  # this step: CPU ns per kind
        self._kind_idx = {k: i for i, k in enumerate(KINDS)}

    def end(self, token, kind, calls, keys, wall_ns, cpu_ns):
        self._probe_end(token, kind, keys)
        self.ns[kind] += wall_ns
        self.cpu_ns[kind] += cpu_ns
        self.calls[kind] += calls
        acc = self.acc
        acc[0] += wall_ns
        acc[1] += cpu_ns
        i = self._kind_idx[kind]
        self.step_kind[i] += wall_ns
        self.step_kind_cpu[i] += cpu_ns


class _DrainCpu(Meter):
    """The drain's regions: only their CPU, summed (not in the step figures)."""

    def __init__(self):
        self.cpu_ns = 0

    def end(self, token, kind, calls, keys, wall_ns, cpu_ns):
        self.cpu_ns += cpu_ns


class NoProgress(RuntimeError):
    """A manager stopped answering: a request never admitted or a job never finished."""


#: why the driver gives a request up (``drive``'s "abandoned")
SELF_EVICTION = ("with only waiting requests left, each lookup scan lost chunks it had "
                 "been answered HIT for to the waiting requests' own promotions")


def drive(mut: Mut, trace, cfg, data_pool: np.ndarray, probe: StepProbe | None = None) -> dict:
    """Run the whole trace through ``mut``; returns the run's raw figures. ``probe``
    (shmtier/bench/slow_steps.py) records what each step is made of (its ``on_gc`` is the
    caller's to register)."""
    probe = probe if probe is not None else StepProbe(KINDS)
    m = mut.manager
    figures = _Figures(probe)
    contract = Contract(mut.LookupResult, mut.ReqContext, mut.ScheduleEndContext)
    d = ConnectorDriver(m, contract=contract, connector=cfg.connector or baseline.connector(),
                        meter=figures, tokens_per_chunk=TOKENS_PER_CHUNK)
    job_keys = d.job_keys
    HIT, PENDING, RETRY = d.HIT, d.PENDING, d.RETRY
    rows = mut.rows
    payload = cfg.chunk_bytes
    step_s = cfg.step_ms / 1e3
    n_pool = len(data_pool)
    ns, cpu_ns, calls, acc = figures.ns, figures.cpu_ns, figures.calls, figures.acc

    step_ns: list[int] = []
    wake_late_ns: list[int] = []  # per step that slept: wake-up after the sleep's end
    step_cpu_ns: list[int] = []
    step_kinds: list[list[int]] = []  # per step: wall ns per kind
    step_kinds_cpu: list[list[int]] = []  # per step: CPU ns per kind
    step_lookups: list[int] = []  # per step: lookup calls
    results = Counter()
    promo_steps, promo_ms = [], []  # RETRY/HIT_PENDING (not our own store) -> HIT
    probe_miss_steps = []  # RETRY/HIT_PENDING -> MISS
    deferrals, queue_steps = [], []
    loaded = Counter()  # load source value -> chunks
    read_back = set()  # distinct keys loaded from a tier other than the CPU tier
    eligible = 0
    alloc_failures = 0
    wrong_kv = verified = bad_bytes = 0
    loaded_promoted = 0  # loaded chunks a tier below the CPU tier promoted for their request
    wrong_by_source = Counter()
    step_hits = []  # per step: (eligible chunks, CPU-tier hits, other-tier hits) of admitted requests
    samples = []  # (step, fs bytes on disk, CPU tier rows holding a stored chunk)
    sample_every = max(1, (trace.last_arrival_step + 1) // cfg.samples) if cfg.samples else 0
    progress_every = max(1, len(trace.requests) // 50)
    next_progress = progress_every
    cpu_rows = set()  # rows the driver filled (an upper bound of the CPU tier's use)
    stored_chunks = 0
    fill_cpu = 0.0
    inflight_store = Counter()  # keys with a store prepared and not yet completed
    abandoned = []  # requests given up (SELF_EVICTION): one dict each
    longest_self_eviction = 0  # most self-evicting scans in a row of any request
    mstats = {"counters": Counter(), "gauge_max": {}, "promo_job_s": []}

    reqs = trace.requests
    ai = 0
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    completions: list = []  # (is_store, req, keys) prepared the step before
    step = 0
    fill_i = 0
    max_steps = trace.last_arrival_step + cfg.max_extra_steps

    try:  # reset this process's peak RSS (VmHWM) so it is this run's
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    pids = list(mut.worker_pids)
    w_cpu0 = [_proc_cpu(p) for p in pids]
    threads0 = _threads_cpu()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, th0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()

    while ai < len(reqs) or waiting or running or completions:
        if step > max_steps:
            raise NoProgress(f"{mut.name}: no progress after {step} steps ({len(waiting)} "
                             f"waiting, {len(running)} running)")
        t_step0 = time.perf_counter()
        while ai < len(reqs) and reqs[ai].arrival_step <= step:
            waiting.append(_Req(reqs[ai]))
            ai += 1
        if cfg.progress is not None and ai >= next_progress:
            next_progress += progress_every
            cfg.progress(ai / len(reqs))
        acc[0] = acc[1] = 0
        step_kind = figures.step_kind = [0] * len(KINDS)
        step_kind_cpu = figures.step_kind_cpu = [0] * len(KINDS)
        st_elig = st_host = st_other = 0
        lookups_before = calls["lookup"]
        new_jobs = []
        new_ids = []
        # Only waiting requests left (the trace has arrived, nothing runs, no job of the
        # driver in flight): between two lookup scans in this state the manager takes rows
        # for nothing but the waiting requests' own promotions (the self-eviction below).
        idle = ai == len(reqs) and not running and not completions
        give_up = []
        with d.locked():
            # -- get_num_new_matched_tokens / update_state_after_alloc
            free = cfg.max_running - len(running)
            skipped = []
            while free > 0 and waiting:
                req = waiting.popleft()
                tr = req.spec
                keys = tr.keys
                if req.ctx is None:
                    req.ctx = d.new_request(f"r{tr.idx}", keys)
                ctx = req.ctx
                g, n = tr.gpu_cached, len(keys)
                answers = d.scan(keys, ctx, g)
                # -- driver bookkeeping (untimed)
                now = time.perf_counter()
                deferred = False
                hits = 0
                for i, r in enumerate(answers):
                    results[r.name] += 1
                    key = keys[g + i]
                    if r is RETRY or r is PENDING:
                        deferred = True
                        if key not in req.pending_since and not (r is PENDING and key in inflight_store):
                            req.pending_since[key] = (step, now)
                    else:
                        since = req.pending_since.pop(key, None)
                        if r is HIT:
                            hits += 1
                            if since is not None:
                                req.promoted.add(key)
                                promo_steps.append(step - since[0])
                                promo_ms.append((now - since[1]) * 1e3)
                        elif since is not None:
                            probe_miss_steps.append(step - since[0])
                if deferred:
                    req.deferrals += 1
                    # Self-eviction: with only waiting requests left, keys this request
                    # was answered HIT for at its last scan (also idle) answer
                    # HIT_PENDING/RETRY now: the manager evicted them for the waiting
                    # requests' own promotions. vLLM's LRU ranks a waiting request's rows
                    # by when it was first seen, below the rows stored since, so once the
                    # CPU tier is full each scan evicts the request's own hits to promote
                    # what the last scan evicted, and it seldom sees its prefix whole
                    # (bench/README.md, "A request vLLM's manager does not admit"). vLLM's
                    # connector defers it step after step; after
                    # ``cfg.self_eviction_scans`` such scans in a row the driver gives it
                    # up, as a client would abort it.
                    lost = 0
                    if idle and req.idle_hits:
                        lost = sum(1 for key, r in zip(keys[g:], answers)
                                   if r is not HIT and key in req.idle_hits)
                    req.self_evictions = req.self_evictions + 1 if lost else 0
                    longest_self_eviction = max(longest_self_eviction, req.self_evictions)
                    if req.self_evictions >= cfg.self_eviction_scans:
                        give_up.append(req)
                        abandoned.append({
                            "req": tr.idx, "arrival_step": tr.arrival_step, "step": step,
                            "deferrals": req.deferrals, "keys": n - g,
                            "scans": req.self_evictions, "why": SELF_EVICTION})
                    else:
                        req.idle_hits = (frozenset(k for k, r in zip(keys[g:], answers)
                                                   if r is HIT) if idle else None)
                        skipped.append(req)
                    continue
                eligible += n - g
                st_elig += n - g
                load_keys = req.admit(hits)
                if load_keys:
                    spec = d.prepare_load(load_keys, ctx)
                    sources = d.load_sources(load_keys, ctx)
                    for key, cid, s in zip(load_keys, np.asarray(spec.block_ids).tolist(), sources):
                        src = getattr(s, "value", str(s))
                        loaded[src] += 1
                        if src == "host":
                            st_host += 1
                        else:
                            st_other += 1
                            read_back.add(key)
                        if key in req.promoted:
                            loaded_promoted += 1
                        verified += 1
                        if not verify_row(rows[cid], key, data_pool, payload):
                            wrong_kv += 1
                            wrong_by_source[src] += 1
                            bad_bytes += wrong_bytes(rows[cid], key, data_pool, payload)
                    new_jobs.append((False, req, job_keys(load_keys)))
                req.admitted = step
                deferrals.append(req.deferrals)
                queue_steps.append(step - tr.arrival_step)
                running.append(req)
                new_ids.append(ctx.req_id)
                free -= 1
            if skipped:
                waiting.extendleft(reversed(skipped))

            # -- build_connector_meta: stores, finished requests, schedule end
            still = []
            to_fill = []
            for req in running:
                action = req.next_action()
                if action == "offer":
                    keys = req.spec.keys
                    offer = list(keys[req.cursor:req.cursor + cfg.batch])
                    out = d.prepare_store(offer, req.ctx)
                    if out is None:
                        alloc_failures += 1  # offered again next step
                    else:
                        to_store = list(out.keys_to_store)
                        if to_store:
                            to_fill.append((to_store, np.asarray(out.store_spec.block_ids).tolist()))
                            new_jobs.append((True, req, job_keys(to_store)))
                            inflight_store.update(to_store)
                            stored_chunks += len(to_store)
                        req.cursor += len(offer)
                    still.append(req)
                elif action == "finish":
                    d.finish(req.ctx)
                else:  # waits for its load, or decodes
                    still.append(req)
            running = still
            for req in give_up:  # aborted while waiting, as the connector finishes it
                d.finish(req.ctx)
            d.end_step(new_ids)

        # -- forward pass: the GPU workers copy the new stores into their rows
        f0 = time.thread_time()
        for keys, cids in to_fill:
            for key, cid in zip(keys, cids):
                row = rows[cid]
                row[:payload] = data_pool[pool_index(key, n_pool)]
                row[:16] = np.frombuffer(key[:16], dtype=np.uint8)
                fill_i += 1
                if sample_every:
                    cpu_rows.add(cid)
        fill_cpu += time.thread_time() - f0
        if sample_every and step % sample_every == 0:  # untimed, inside the forward pass's sleep
            samples.append((step, _dir_bytes(mut.root), len(cpu_rows)))
        left = step_s - (time.perf_counter() - t_step0)
        if left > 0:
            time.sleep(left)
            # how late the thread got its CPU back after the forward pass (tier workers and
            # I/O threads in a long system call, or holding the core, delay it)
            wake_late_ns.append(int((time.perf_counter() - t_step0 - step_s) * 1e9))

        # -- update_connector_output, engine hooks
        d.complete_jobs([(is_store, keys, req.ctx) for is_store, req, keys in completions])
        for is_store, req, keys in completions:  # driver bookkeeping (untimed)
            if is_store:
                inflight_store.subtract(keys)
                for key in keys:
                    if inflight_store[key] <= 0:
                        del inflight_store[key]
            else:
                req.waiting_load = False
        completions = new_jobs
        # untimed: the manager's own metrics over the run
        fold_stats(mstats, d.engine_hooks().stats)
        step_ns.append(acc[0])
        step_cpu_ns.append(acc[1])
        step_kinds.append(step_kind)
        step_kinds_cpu.append(step_kind_cpu)
        probe.step_end()
        step_lookups.append(calls["lookup"] - lookups_before)
        step_hits.append((st_elig, st_host, st_other))
        step += 1

    # drain: idle engine steps until the manager has nothing in flight (not in step stats)
    drain = _DrainCpu()
    d.measure(drain)
    steps = d.settle(cfg.drain_timeout_s, sleep_s=step_s, stats=lambda s: fold_stats(mstats, s))
    if steps is None:
        raise NoProgress(f"{mut.name}: still has pending work {cfg.drain_timeout_s:g} s "
                         f"after the trace")
    drain_steps = steps - 1  # the last one found nothing pending
    drain_cpu_ns = drain.cpu_ns  # this thread's CPU inside the manager's calls while draining

    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    main_cpu = time.thread_time() - th0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    w_cpu1 = [_proc_cpu(p) for p in pids]
    threads_cpu = _threads_delta(threads0, _threads_cpu())
    alive = [p for p in getattr(mut.pool, "_procs", []) if p is not None]
    workers_cpu = workers_by_lane = None
    if pids:
        workers_by_lane = _workers_cpu(mut, w_cpu0, w_cpu1)
        workers_cpu = sum(v["user"] + v["sys"] for v in workers_by_lane.values())
    rss = [_proc_rss_anon_mib(p.pid) for p in alive]
    worker_hwm = [_proc_status_mib(p.pid, "VmHWM") for p in alive]
    if sample_every:
        samples.append((step, _dir_bytes(mut.root), len(cpu_rows)))
    return {
        "steps": len(step_ns), "drain_steps": drain_steps, "step_ns": step_ns,
        "wake_late_ns": wake_late_ns,
        "step_cpu_ns": step_cpu_ns, "step_kinds": step_kinds, "step_kinds_cpu": step_kinds_cpu,
        "step_lookups": step_lookups,
        "slow": probe.result(),
        "ns": ns, "cpu_ns": cpu_ns, "calls": calls,
        "lookup_results": dict(results),
        "promo_steps": promo_steps, "promo_ms": promo_ms, "probe_miss_steps": probe_miss_steps,
        "deferrals": deferrals, "queue_steps": queue_steps, "abandoned": abandoned,
        "self_eviction_scans_max": longest_self_eviction,
        "loaded": dict(loaded), "read_back_keys": len(read_back), "eligible": eligible, "alloc_failures": alloc_failures,
        "wrong_kv": wrong_kv, "wrong_bytes": bad_bytes, "verified": verified,
        "loaded_promoted": loaded_promoted, "stored_chunks": stored_chunks,
        "wrong_by_source": dict(wrong_by_source), "verified_bytes": verified * payload,
        "step_hits": step_hits, "samples": samples,
        "peak_rss_mib": _proc_status_mib(os.getpid(), "VmHWM"), "worker_peak_rss_mib": worker_hwm,
        "wall_s": wall, "cpu_s": cpu, "main_thread_cpu_s": main_cpu, "fill_cpu_s": fill_cpu,
        # this thread's CPU inside the manager's calls (and the lock waits): the timed
        # regions of the steps plus the drain's calls; the rest of main_thread_cpu_s is
        # the driver's own work (trace, bookkeeping, row fill and checks, clocks, sleeps)
        "manager_main_cpu_s": (sum(cpu_ns.values()) + drain_cpu_ns) / 1e9,
        "ru_user_s": ru1.ru_utime - ru0.ru_utime, "ru_sys_s": ru1.ru_stime - ru0.ru_stime,
        "ru_nvcsw": ru1.ru_nvcsw - ru0.ru_nvcsw, "ru_nivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw,
        "workers_cpu_s": workers_cpu, "workers_cpu_by_lane": workers_by_lane,
        "threads_cpu": threads_cpu,
        "worker_rss_anon_mib": rss,
        "worker_restarts": getattr(mut.pool, "restarts_total", None),
        "mstats": {"counters": dict(mstats["counters"]), "gauge_max": mstats["gauge_max"],
                   "promo_job_s": mstats["promo_job_s"]},
    }


PROMOTION_LATENCY = "vllm:kv_offload_tiering_promotion_latency_seconds"
MANAGER_COUNTERS = (  # (row label, metric name): the same names in shmtier and vLLM
    ("promotion jobs failed", "vllm:kv_offload_tiering_promotion_job_failures"),
    ("cascade jobs failed", "vllm:kv_offload_tiering_cascade_job_failures"),
    ("promotions refused: no primary row", "vllm:kv_offload_tiering_promotion_allocation_failures"),
    ("cascades dropped by backpressure", "vllm:kv_offload_tiering_backpressure_stores_dropped"),
    ("  their chunks", "vllm:kv_offload_tiering_backpressure_blocks_dropped"),
)
#: bytes of chunks cascaded to / promoted from the secondary tiers (successful jobs x row bytes)
WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
READ_BYTES = "vllm:kv_offload_tiering_read_bytes"


def fold_stats(acc: dict, stats) -> None:
    """Fold one get_stats() payload (shmtier's or vLLM's: both are {"types", "data"})."""
    data = getattr(stats, "data", None)
    if not isinstance(data, dict) or "data" not in data:
        return
    types = data.get("types", {})
    for name, series in data["data"].items():
        kind = str(getattr(types.get(name), "value", types.get(name))).lower()
        for value in series.values():
            if "counter" in kind:
                acc["counters"][name] += value
            elif "gauge" in kind:
                acc["gauge_max"][name] = max(acc["gauge_max"].get(name, value), value)
            elif "histogram" in kind and name == PROMOTION_LATENCY:
                acc["promo_job_s"].extend(value)


def disk_usage(root: str, ext: str) -> dict:
    files = other = dirs = size = alloc = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirs += len(dirnames)
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if name.endswith(ext):
                files += 1
                size += st.st_size
                alloc += st.st_blocks * 512
            else:
                other += 1
    return {"chunk_files": files, "other_files": other, "dirs": dirs, "bytes": size,
            "alloc_bytes": alloc}


#: run directories emptied by ``retire_root``, removed at exit
_RETIRED: list[str] = []


def _remove_retired() -> None:
    while _RETIRED:
        shutil.rmtree(_RETIRED.pop(), ignore_errors=True)


def retire_root(root: str) -> None:
    """Empty a finished run's fs directory now (every file truncated: its blocks and page
    cache freed) and remove the tree when this process exits.

    Not removed at once because ext4 without a journal (this VM's root filesystem) keeps a
    freed inode from reuse for 60 s (longer while its inode table block is dirty) and scans
    past every such inode of the group at each file creation (``recently_deleted``): one
    run's ~3000 files and ~1600 directories, removed before the next run, cost that run's
    file creations (shmtier's tier workers, vLLM's I/O threads) up to 44% of their CPU
    (bench/README.md, "Runs that pay for the last run's deletions")."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            try:
                os.truncate(os.path.join(dirpath, name), 0)
            except OSError:
                pass
    if not _RETIRED:
        atexit.register(_remove_retired)
    _RETIRED.append(root)


def run_once_more_on_stall(name: str, trace, cfg, data_pool, run_no: int, stalls: list,
                           run=None) -> tuple[dict, int]:
    """``run_one`` (or ``run``, same arguments), and once more as run ``run_no + 1`` if the
    first attempt made no progress (``NoProgress``; its directory and segments are cleaned
    up as after any run): one stalled run then costs a repeat instead of the whole set.
    Each stall is printed and appended to ``stalls`` as ``{"manager", "run_no",
    "error"}``; a second stall in a row raises it. Returns the run's figures and the run
    number it used."""
    run = run_one if run is None else run
    try:
        return run(name, trace, cfg, data_pool, run_no), run_no
    except NoProgress as e:
        stalls.append({"manager": name, "run_no": run_no, "error": str(e)})
        print(f"  ! {name}: run {run_no} made no progress ({e}); running it again", flush=True)
    return run(name, trace, cfg, data_pool, run_no + 1), run_no + 1


def run_one(name: str, trace, cfg, data_pool, run_no: int, profiler=None) -> dict:
    safe = name.replace("@", "_")
    engine_id = f"{TAG}{run_no}-{safe}"
    root = tempfile.mkdtemp(prefix=f"{TAG}{run_no}-{safe}-", dir=cfg.dir)
    base, _, sched = name.partition("@")
    mut = None
    try:
        os.sync()
        t0 = time.perf_counter()
        mut = (make_shmtier(cfg, root, engine_id, sched) if base == "shmtier"
               else MAKERS[base](cfg, root, engine_id))
        build_s = time.perf_counter() - t0
        res = measure(mut, trace, cfg, data_pool, profiler)
        res["build_s"] = build_s
        t0 = time.perf_counter()
        mut.close()
        res["shutdown_s"] = time.perf_counter() - t0
        res["disk"] = disk_usage(root, mut.chunk_ext)
        return res
    finally:
        if mut is not None:
            try:
                mut.close()
            except Exception as e:  # noqa: BLE001 - report, keep cleaning
                print(f"  ! {name}: shutdown failed: {type(e).__name__}: {e}", file=sys.stderr)
        retire_root(root)
        left = sweep_shm(engine_id)
        if left:
            print(f"  ! {name}: removed leftover /dev/shm entries: {left}", file=sys.stderr)


def measure(mut: Mut, trace, cfg, data_pool, profiler=None) -> dict:
    """One run of ``trace`` through a built manager (``mut``, left open: the caller closes
    it): the GC heap frozen first as vLLM's engine core does, each step probed
    (shmtier/bench/slow_steps.py), ``drive``; its raw figures with the run's GC, the CPU
    tier's size and the workers' scheduling added. ``profiler``: enabled around ``drive``."""
    num_chunks = mut.rows.shape[0]
    # like vLLM's engine core after init (freeze_gc_heap): static objects out of the GC's way
    gc.collect()
    gc.freeze()
    gc_log = []

    def gc_cb(phase, info, _t=[0.0]):
        if phase == "start":
            _t[0] = time.perf_counter()
        else:
            gc_log.append((info["generation"], time.perf_counter() - _t[0]))

    gc.callbacks.append(gc_cb)
    probe = StepProbe(KINDS)  # what each step is made of (shmtier/bench/slow_steps.py)
    gc.callbacks.append(probe.on_gc)
    if profiler is not None:
        profiler.enable()
    try:
        res = drive(mut, trace, cfg, data_pool, probe)
    except BaseException as e:
        # the traceback's frames hold numpy views of the arena: drop them so the
        # managers can unmap it (also on Ctrl-C / SIGTERM)
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if profiler is not None:
            profiler.disable()
        gc.callbacks.remove(gc_cb)
        gc.callbacks.remove(probe.on_gc)
        gc.unfreeze()
    res["gc"] = {"collections": len(gc_log), "gen2": sum(1 for g, _ in gc_log if g == 2),
                 "total_ms": sum(d for _, d in gc_log) * 1e3,
                 "max_ms": max((d for _, d in gc_log), default=0.0) * 1e3}
    res["num_chunks"] = num_chunks
    res["row_stride"] = mut.rows.shape[1]
    res["worker_sched"] = sorted({sched_of(pid) for pid in mut.worker_pids})  # at the end
    res["window_poll"] = getattr(mut.manager, "window_poll_rounds", None)
    return res
