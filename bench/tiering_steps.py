#!/usr/bin/env python
"""Scheduler-side cost of tiering per engine step: shmtier vs vLLM 0.33, same trace.

Run from a checkout::

    .venv/bin/python bench/tiering_steps.py                 # 3 interleaved runs per manager (~75 s)
    .venv/bin/python bench/tiering_steps.py --quick         # smoke test: 1 small run each (~15 s)
    .venv/bin/python bench/tiering_steps.py --repeats 5 --json bench/results/tiering_steps.json
    .venv/bin/python bench/tiering_steps.py --managers shmtier,shmtier@nice0,shmtier@raw,vllm
    .venv/bin/python bench/tiering_steps.py --profile shmtier    # cProfile one run instead

Two managers, built the same size (CPU tier bytes, chunk bytes) with an ``fs``
secondary tier on a fresh temp directory each run (unbounded), are driven by the
same driver on the same multi-turn chat trace (bench/trace.py):

* ``shmtier``: ``shmtier.spec.TieringOffloadingSpec(...).get_manager()`` - primary
  tier in one POSIX shm segment, fs tier I/O and compression in tier worker
  processes (``num_tier_workers``);
* ``vllm``: vLLM 0.33's own ``TieringOffloadingManager`` with its
  ``CPUPrimaryTierOffloadingManager`` over a ``SharedOffloadRegion`` and its
  ``FileSystemTierManager`` (thread pool and async-lookup thread in this process),
  built from the real classes; the fs tier gets a minimal stand-in for the
  ``OffloadingSpec`` with exactly the attributes it reads (``config`` fields for
  its FileMapper namespace, ``blocks_per_chunk``, ``kv_events_config``).

The driver plays the OffloadingConnector's scheduler half (contract §2.3), once
per step, with ``manager.lock`` held: admit waiting requests (``on_new_request``
once, then a lookup scan over the prefix after the GPU-cached chunks until MISS;
HIT_PENDING or RETRY defers the request to the next step, RETRY does not stop the
scan; hits -> ``prepare_load`` + ``get_load_source`` per loaded key); every
running request offers its next chunks to ``prepare_store`` (the driver then
writes the rows, standing in for the GPU copy; its read of the spec's ``block_ids`` is
not timed, for either manager: vLLM's spec builds that array in ``prepare_store``,
shmtier's on that first read, as a GPU worker's copy would); finished requests ->
``on_request_finished``; ``on_schedule_end``. Then the "forward pass" (a sleep),
then ``update_connector_output``: jobs prepared the step before complete
(``complete_store`` / ``complete_load``), then ``has_pending_work``,
``get_stats`` and ``take_events``. Every manager call is timed with
``perf_counter_ns`` (and ``thread_time_ns``, its on-CPU part); their sum is the
step's scheduler-thread time.

Variants ``shmtier@TOKENS`` (interleaved with the others) change what shmtier's
tier workers run with after they start: scheduling (``nice0``, ``batch0``, ...,
see --worker-sched) and/or compression (``raw`` = none, ``zstd``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import json
import os
import platform
import pstats
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def _load_trace_module():
    """bench/trace.py by path: the name ``trace`` is also a stdlib module."""
    spec = importlib.util.spec_from_file_location("shmtier_bench_trace",
                                                  os.path.join(BENCH_DIR, "trace.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


bench_trace = _load_trace_module()

TOKENS_PER_CHUNK = 16
MODEL = "bench/tiering-steps"
TAG = f"bench-ts-{os.getpid()}-"
LABELS = {"shmtier": "shmtier", "vllm": "vLLM 0.33"}


def label(name: str) -> str:
    """Column label of a manager name: ``vllm``, ``shmtier`` or ``shmtier@<worker-sched>``."""
    return LABELS.get(name, name)
KINDS = ("lock wait", "on_new_request", "lookup", "prepare_load", "get_load_source",
         "prepare_store", "on_request_finished", "on_schedule_end", "complete_store",
         "complete_load", "has_pending_work", "get_stats", "take_events")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- managers


@dataclass
class Mut:
    """A manager under test and what the driver needs around it."""

    name: str
    manager: object
    rows: np.ndarray  # (num_chunks, row_stride) uint8 view of the CPU tier
    ReqContext: type
    LookupResult: type
    ScheduleEndContext: type
    root: str
    chunk_ext: str
    engine_id: str
    worker_pids: list = field(default_factory=list)
    pool: object = None
    worker_sched: list = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.rows = None  # drop the numpy view: the arena can then be unmapped
        gc.collect()
        self.manager.shutdown()


def _sweep_shm(engine_id: str) -> list[str]:
    """Remove /dev/shm entries of ``engine_id`` (segment, semaphores, vLLM region)."""
    left = []
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return left
    for name in names:
        if engine_id in name:
            left.append(name)
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
    return left


WORKER_SCHED = {
    "default": "as the workers set themselves",
    "nice0": "niceness 0 (the scheduler's)",
    "nice5": "niceness 5",
    "nice19": "niceness 19",
    "batch0": "SCHED_BATCH at niceness 0 (no wake-up preemption, fair share)",
    "batch": "SCHED_BATCH, niceness kept",
    "idle": "SCHED_IDLE",
}


def apply_worker_sched(pid: int, how: str) -> None:
    if how == "default":
        return
    if how.startswith("nice"):
        os.setpriority(os.PRIO_PROCESS, pid, int(how[4:]))
    elif how == "batch0":
        os.setpriority(os.PRIO_PROCESS, pid, 0)
        os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))
    elif how == "batch":
        os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))
    elif how == "idle":
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))


def _sched_of(pid: int) -> str:
    try:
        policy = {os.SCHED_OTHER: "OTHER", os.SCHED_BATCH: "BATCH",
                  os.SCHED_IDLE: "IDLE"}.get(os.sched_getscheduler(pid), "?")
        return f"{policy}/nice {os.getpriority(os.PRIO_PROCESS, pid)}"
    except OSError:
        return "?"


def make_shmtier(cfg, root: str, engine_id: str, variant: str = "") -> Mut:
    """``variant``: '+'-joined tokens, each a WORKER_SCHED key or a compression mode
    (``raw`` = "none", ``zstd``), e.g. ``raw+nice0``."""
    tokens = [t for t in variant.split("+") if t]
    sched = next((t for t in tokens if t in WORKER_SCHED), cfg.worker_sched)
    compression = {"raw": "none", "zstd": "zstd"}.get(
        next((t for t in tokens if t in ("raw", "zstd")), ""), cfg.compression)
    from shmtier import contract
    from shmtier.config import KVLayout
    from shmtier.spec import TieringOffloadingSpec

    layout = KVLayout(MODEL, "bfloat16", TOKENS_PER_CHUNK, cfg.chunk_bytes, 1)
    extra = {"cpu_bytes_to_use": cfg.cpu_bytes,
             "secondary_tiers": [{"type": "fs", "root_dir": root, "min_free_bytes": None,
                                  "direct_io": cfg.direct_io}],
             "num_tier_workers": cfg.workers, "compression": compression}
    spec = TieringOffloadingSpec(extra, layout, engine_id)
    manager = spec.get_manager()
    try:
        rows = np.asarray(manager.primary.get_kv_memoryview())
        pool = spec.worker_pool
        pids = [p.pid for p in pool._procs if p is not None]
        # Wait until every worker is up (claimed its ring slot: past its own start-up
        # settings, e.g. its niceness), so the run starts warm and a --worker-sched
        # experiment is not undone by the worker itself.
        deadline = time.monotonic() + 30
        while any(pool.rings.worker(w).last_beat().pid != pid for w, pid in enumerate(pids)):
            if time.monotonic() > deadline:
                raise RuntimeError("shmtier tier workers did not start within 30 s")
            time.sleep(0.005)
        for pid in pids:  # experiment: --worker-sched (what the workers could do themselves)
            apply_worker_sched(pid, sched)
        mut = Mut("shmtier", manager, rows, contract.ReqContext, contract.LookupResult,
                  contract.ScheduleEndContext, root, ".kv", engine_id, pids, pool)
        mut.worker_sched = sorted({_sched_of(pid) for pid in pids})
        return mut
    except BaseException:
        manager.shutdown()
        raise


def _vllm_spec_standin(cfg):
    """The attributes vLLM 0.33's FileSystemTierManager reads from its offloading_spec:
    ``blocks_per_chunk``, ``kv_events_config.enable_kv_cache_events`` (only with
    enable_kv_events) and, for FileMapper.from_offloading_spec, ``config.groups``,
    ``config.model``, ``config.cache``, ``config.parallel``, ``config.replicated_layout``,
    ``config.canonical_layout``, ``config.kv_cache_layout``."""
    config = SimpleNamespace(
        groups=(SimpleNamespace(tokens_per_block=TOKENS_PER_CHUNK, layer_names=("layers.0",)),),
        model=SimpleNamespace(name=MODEL, dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=TOKENS_PER_CHUNK, blocks_per_chunk=1),
        parallel=SimpleNamespace(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1,
                                 dcp_size=1, is_parallelism_agnostic=False),
        replicated_layout=False, canonical_layout=False, kv_cache_layout=None)
    return SimpleNamespace(config=config, blocks_per_chunk=1,
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=False))


def make_vllm(cfg, root: str, engine_id: str) -> Mut:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    row = -(-cfg.chunk_bytes // 4096) * 4096
    num_chunks = cfg.cpu_bytes // row
    region = SharedOffloadRegion(engine_id=engine_id, num_chunks=num_chunks, rank=None,
                                 kv_bytes_per_chunk=row, cpu_page_size=cfg.chunk_bytes)
    undo = [region.cleanup]
    try:
        primary = CPUPrimaryTierOffloadingManager(num_chunks=num_chunks, mmap_region=region,
                                                  cache_policy="lru", enable_events=False)
        undo = [primary.shutdown]  # releases the view and cleans the region up
        tier = SecondaryTierFactory.create_secondary_tier(
            {"type": "fs", "root_dir": root}, primary.get_kv_memoryview(), _vllm_spec_standin(cfg))
        undo.insert(0, tier.shutdown)
        manager = TieringOffloadingManager(primary, [tier])  # default poll interval (no poll thread for fs)
        rows = np.asarray(primary.get_kv_memoryview())
        return Mut("vllm", manager, rows, ReqContext, LookupResult, ScheduleEndContext, root,
                   ".bin", engine_id)
    except BaseException:
        for step in undo:
            try:
                step()
            except Exception:  # noqa: BLE001 - keep undoing
                pass
        raise


MAKERS = {"shmtier": make_shmtier, "vllm": make_vllm}


# --------------------------------------------------------------------------- driver


@dataclass(slots=True)
class _Req:
    tr: object
    ctx: object = None
    cursor: int = 0
    waiting_load: bool = False
    decode_left: int = 0
    deferrals: int = 0
    admitted: int = -1
    pending_since: dict = field(default_factory=dict)  # key -> (step, perf_counter)


def _proc_cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def _proc_rss_anon_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class NoProgress(RuntimeError):
    pass


def drive(mut: Mut, trace, cfg, data_pool: np.ndarray) -> dict:
    """Run the whole trace through ``mut``; returns the run's raw figures."""
    m = mut.manager
    LR = mut.LookupResult
    HIT, MISS, PENDING, RETRY = LR.HIT, LR.MISS, LR.HIT_PENDING, LR.RETRY
    ReqContext, SEC = mut.ReqContext, mut.ScheduleEndContext
    lock = m.lock
    lookup = m.lookup
    pc = time.perf_counter_ns
    tt = time.thread_time_ns
    rows = mut.rows
    payload = cfg.chunk_bytes
    step_s = cfg.step_ms / 1e3
    n_pool = len(data_pool)

    ns = dict.fromkeys(KINDS, 0)  # wall ns inside the calls
    cpu_ns = dict.fromkeys(KINDS, 0)  # this thread's CPU ns around the calls
    calls = dict.fromkeys(KINDS, 0)
    acc = [0, 0]  # this step: wall ns, cpu ns
    kind_idx = {k: i for i, k in enumerate(KINDS)}
    step_kind = [0] * len(KINDS)  # this step: wall ns per kind
    cur_kind = [step_kind]

    def timed(kind, fn, *args):
        c0 = tt()
        w0 = pc()
        out = fn(*args)
        w1 = pc()
        c1 = tt()
        ns[kind] += w1 - w0
        cpu_ns[kind] += c1 - c0
        calls[kind] += 1
        acc[0] += w1 - w0
        acc[1] += c1 - c0
        cur_kind[0][kind_idx[kind]] += w1 - w0
        return out

    class locked:
        """``with lock``, the wait for it timed as scheduler-thread time ("lock wait"):
        a manager's own threads (shmtier's tier-poll thread) may hold it."""

        def __enter__(self):
            c0 = tt()
            w0 = pc()
            lock.acquire()
            w1 = pc()
            c1 = tt()
            ns["lock wait"] += w1 - w0
            cpu_ns["lock wait"] += c1 - c0
            calls["lock wait"] += 1
            acc[0] += w1 - w0
            acc[1] += c1 - c0
            cur_kind[0][kind_idx["lock wait"]] += w1 - w0

        def __exit__(self, *exc):
            lock.release()

    step_ns: list[int] = []
    step_cpu_ns: list[int] = []
    step_kinds: list[list[int]] = []  # per step: wall ns per kind
    step_lookups: list[int] = []  # per step: lookup calls
    results = Counter()
    promo_steps, promo_ms = [], []  # RETRY/HIT_PENDING (not our own store) -> HIT
    probe_miss_steps = []  # RETRY/HIT_PENDING -> MISS
    deferrals, queue_steps = [], []
    loaded = Counter()  # load source value -> chunks
    eligible = 0
    alloc_failures = 0
    wrong_kv = verified = 0
    stored_chunks = 0
    fill_cpu = 0.0
    inflight_store = Counter()  # keys with a store prepared and not yet completed
    mstats = {"counters": Counter(), "gauge_max": {}, "promo_job_s": []}

    reqs = trace.requests
    ai = 0
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    completions: list = []  # (is_store, req, keys) prepared the step before
    step = 0
    fill_i = 0
    max_steps = trace.last_arrival_step + cfg.max_extra_steps

    pids = list(mut.worker_pids)
    w_cpu0 = [_proc_cpu_s(p) for p in pids]
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
        acc[0] = acc[1] = 0
        step_kind = cur_kind[0] = [0] * len(KINDS)
        lookups_before = calls["lookup"]
        new_jobs = []
        new_ids = []
        with locked():
            # -- get_num_new_matched_tokens / update_state_after_alloc
            free = cfg.max_running - len(running)
            skipped = []
            while free > 0 and waiting:
                req = waiting.popleft()
                tr = req.tr
                keys = tr.keys
                if req.ctx is None:
                    ctx = req.ctx = ReqContext(req_id=f"r{tr.idx}")
                    for i, key in enumerate(keys):
                        ctx.set_offload_key_position(key, (i + 1) * TOKENS_PER_CHUNK)
                    timed("on_new_request", m.on_new_request, ctx)
                ctx = req.ctx
                g, n = tr.gpu_cached, len(keys)
                answers = []
                c0 = tt()
                w0 = pc()
                for i in range(g, n):
                    r = lookup(keys[i], ctx)
                    answers.append(r)
                    if r is MISS:
                        break
                w1 = pc()
                c1 = tt()
                ns["lookup"] += w1 - w0
                cpu_ns["lookup"] += c1 - c0
                calls["lookup"] += len(answers)
                acc[0] += w1 - w0
                acc[1] += c1 - c0
                step_kind[kind_idx["lookup"]] += w1 - w0
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
                                promo_steps.append(step - since[0])
                                promo_ms.append((now - since[1]) * 1e3)
                        elif since is not None:
                            probe_miss_steps.append(step - since[0])
                if deferred:
                    req.deferrals += 1
                    skipped.append(req)
                    continue
                hits = min(hits, n - 1 - g)  # at least one chunk is computed
                eligible += n - g
                if hits > 0:
                    load_keys = list(keys[g:g + hits])
                    spec = timed("prepare_load", m.prepare_load, load_keys, ctx)
                    c0 = tt()
                    w0 = pc()
                    sources = [m.get_load_source(k, ctx) for k in load_keys]
                    w1 = pc()
                    c1 = tt()
                    ns["get_load_source"] += w1 - w0
                    cpu_ns["get_load_source"] += c1 - c0
                    calls["get_load_source"] += len(load_keys)
                    acc[0] += w1 - w0
                    acc[1] += c1 - c0
                    step_kind[kind_idx["get_load_source"]] += w1 - w0
                    for s in sources:
                        loaded[getattr(s, "value", str(s))] += 1
                    for key, cid in zip(load_keys, np.asarray(spec.block_ids).tolist()):
                        verified += 1
                        if rows[cid, :16].tobytes() != key[:16]:
                            wrong_kv += 1
                    new_jobs.append((False, req, load_keys))
                    req.waiting_load = True
                    req.cursor = g + hits
                else:
                    req.cursor = 0  # GPU-cached chunks are offered again (prepare_store filters)
                req.decode_left = tr.decode_steps
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
                keys = req.tr.keys
                if req.waiting_load:
                    still.append(req)
                elif req.cursor < len(keys):
                    offer = list(keys[req.cursor:req.cursor + cfg.batch])
                    out = timed("prepare_store", m.prepare_store, offer, req.ctx)
                    if out is None:
                        alloc_failures += 1  # offered again next step
                    else:
                        to_store = list(out.keys_to_store)
                        if to_store:
                            to_fill.append((to_store, np.asarray(out.store_spec.block_ids).tolist()))
                            new_jobs.append((True, req, to_store))
                            inflight_store.update(to_store)
                            stored_chunks += len(to_store)
                        req.cursor += len(offer)
                    still.append(req)
                elif req.decode_left > 0:
                    req.decode_left -= 1
                    still.append(req)
                else:
                    timed("on_request_finished", m.on_request_finished, req.ctx)
            running = still
            timed("on_schedule_end", m.on_schedule_end, SEC(new_ids, ()))

        # -- forward pass: the GPU workers copy the new stores into their rows
        f0 = time.thread_time()
        for keys, cids in to_fill:
            for key, cid in zip(keys, cids):
                row = rows[cid]
                row[:payload] = data_pool[fill_i % n_pool]
                row[:16] = np.frombuffer(key[:16], dtype=np.uint8)
                fill_i += 1
        fill_cpu += time.thread_time() - f0
        left = step_s - (time.perf_counter() - t_step0)
        if left > 0:
            time.sleep(left)

        # -- update_connector_output, engine hooks
        with locked():
            for is_store, req, keys in completions:
                if is_store:
                    timed("complete_store", m.complete_store, keys, req.ctx)
                    inflight_store.subtract(keys)
                    for key in keys:
                        if inflight_store[key] <= 0:
                            del inflight_store[key]
                else:
                    timed("complete_load", m.complete_load, keys, req.ctx)
                    req.waiting_load = False
        completions = new_jobs
        with locked():
            timed("has_pending_work", m.has_pending_work)
        with locked():
            stats = timed("get_stats", m.get_stats)
        fold_stats(mstats, stats)  # untimed: the manager's own metrics over the run
        with locked():
            timed("take_events", lambda: list(m.take_events()))
        step_ns.append(acc[0])
        step_cpu_ns.append(acc[1])
        step_kinds.append(step_kind)
        step_lookups.append(calls["lookup"] - lookups_before)
        step += 1

    # drain: idle engine steps until the manager has nothing in flight (not in step stats)
    drain_steps = 0
    deadline = time.perf_counter() + cfg.drain_timeout_s
    while True:
        with locked():
            pending = m.has_pending_work()
            if pending:
                m.on_schedule_end(SEC((), ()))
                fold_stats(mstats, m.get_stats())
        if not pending:
            break
        if time.perf_counter() > deadline:
            raise NoProgress(f"{mut.name}: still has pending work {cfg.drain_timeout_s:g} s "
                             f"after the trace")
        drain_steps += 1
        time.sleep(step_s)

    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    main_cpu = time.thread_time() - th0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    w_cpu1 = [_proc_cpu_s(p) for p in pids]
    alive = [p for p in getattr(mut.pool, "_procs", []) if p is not None]
    workers_cpu = None
    if pids:
        workers_cpu = sum((b or 0) - (a or 0) for a, b in zip(w_cpu0, w_cpu1))
    rss = [_proc_rss_anon_mib(p.pid) for p in alive]
    return {
        "steps": len(step_ns), "drain_steps": drain_steps, "step_ns": step_ns,
        "step_cpu_ns": step_cpu_ns, "step_kinds": step_kinds, "step_lookups": step_lookups,
        "ns": ns, "cpu_ns": cpu_ns, "calls": calls,
        "lookup_results": dict(results),
        "promo_steps": promo_steps, "promo_ms": promo_ms, "probe_miss_steps": probe_miss_steps,
        "deferrals": deferrals, "queue_steps": queue_steps,
        "loaded": dict(loaded), "eligible": eligible, "alloc_failures": alloc_failures,
        "wrong_kv": wrong_kv, "verified": verified, "stored_chunks": stored_chunks,
        "wall_s": wall, "cpu_s": cpu, "main_thread_cpu_s": main_cpu, "fill_cpu_s": fill_cpu,
        "ru_user_s": ru1.ru_utime - ru0.ru_utime, "ru_sys_s": ru1.ru_stime - ru0.ru_stime,
        "ru_nvcsw": ru1.ru_nvcsw - ru0.ru_nvcsw, "ru_nivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw,
        "workers_cpu_s": workers_cpu, "worker_rss_anon_mib": rss,
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
)
RING_DEPTH = "vllm:kv_offload_shmtier_ring_depth"


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
        if profiler is not None:
            profiler.enable()
        try:
            res = drive(mut, trace, cfg, data_pool)
        except BaseException as e:
            # the traceback's frames hold numpy views of the arena: drop them so the
            # managers can unmap it (also on Ctrl-C / SIGTERM)
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            if profiler is not None:
                profiler.disable()
            gc.callbacks.remove(gc_cb)
            gc.unfreeze()
        res["gc"] = {"collections": len(gc_log), "gen2": sum(1 for g, _ in gc_log if g == 2),
                     "total_ms": sum(d for _, d in gc_log) * 1e3,
                     "max_ms": max((d for _, d in gc_log), default=0.0) * 1e3}
        res["build_s"] = build_s
        res["num_chunks"] = num_chunks
        res["row_stride"] = mut.rows.shape[1]
        res["worker_sched"] = sorted({_sched_of(pid) for pid in mut.worker_pids})  # at the end
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
        shutil.rmtree(root, ignore_errors=True)
        left = _sweep_shm(engine_id)
        if left:
            print(f"  ! {name}: removed leftover /dev/shm entries: {left}", file=sys.stderr)


# --------------------------------------------------------------------------- report


def pct(values, q):
    """Nearest-rank percentile (q in 0..100); None for an empty sequence."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarise(res: dict, chunk_bytes: int) -> dict:
    steps_us = [v / 1e3 for v in res["step_ns"]]
    cpu_us = [v / 1e3 for v in res["step_cpu_ns"]]
    n_steps = len(steps_us)
    total_lookups = res["calls"]["lookup"]
    loaded_total = sum(res["loaded"].values())
    host = res["loaded"].get("host", 0)
    disk = res["loaded"].get("disk", 0)
    elig = res["eligible"] or 1
    d = res["disk"]
    logical = d["chunk_files"] * chunk_bytes
    defer = res["deferrals"]
    s = {
        "step_us_p50": pct(steps_us, 50), "step_us_p90": pct(steps_us, 90),
        "step_us_p99": pct(steps_us, 99), "step_us_max": max(steps_us),
        "step_us_mean": sum(steps_us) / n_steps,
        "manager_ms_total": sum(steps_us) / 1e3,
        "step_cpu_us_p50": pct(cpu_us, 50), "step_cpu_us_p99": pct(cpu_us, 99),
        "step_cpu_us_max": max(cpu_us), "step_cpu_us_mean": sum(cpu_us) / n_steps,
        "offcpu_us_p99": pct([w - c for w, c in zip(steps_us, cpu_us)], 99),
        "steps": n_steps, "drain_steps": res["drain_steps"],
        "cpu_s": res["cpu_s"], "main_thread_cpu_s": res["main_thread_cpu_s"],
        "other_threads_cpu_s": res["cpu_s"] - res["main_thread_cpu_s"],
        "fill_cpu_s": res["fill_cpu_s"],
        "cpu_excl_fill_s": res["cpu_s"] - res["fill_cpu_s"],
        "sys_cpu_s": res["ru_sys_s"],
        "vol_ctx_switches": res["ru_nvcsw"], "invol_ctx_switches": res["ru_nivcsw"],
        "workers_cpu_s": res["workers_cpu_s"],
        "promo_n": len(res["promo_steps"]),
        "promo_steps_p50": pct(res["promo_steps"], 50), "promo_steps_p99": pct(res["promo_steps"], 99),
        "promo_ms_p50": pct(res["promo_ms"], 50), "promo_ms_p99": pct(res["promo_ms"], 99),
        "promo_ms_max": max(res["promo_ms"]) if res["promo_ms"] else None,
        "probe_miss_n": len(res["probe_miss_steps"]),
        "defer_mean": sum(defer) / len(defer) if defer else None,
        "defer_p50": pct(defer, 50), "defer_p99": pct(defer, 99),
        "defer_max": max(defer) if defer else None,
        "deferred_frac": sum(1 for x in defer if x) / len(defer) if defer else None,
        "queue_p50": pct(res["queue_steps"], 50), "queue_p99": pct(res["queue_steps"], 99),
        "lookups": total_lookups, "lookups_per_step": total_lookups / n_steps,
        "lookups_per_loaded_chunk": total_lookups / loaded_total if loaded_total else None,
        "pending_frac": (res["lookup_results"].get("HIT_PENDING", 0)
                         + res["lookup_results"].get("RETRY", 0)) / max(1, total_lookups),
        "hit_cpu": host / elig, "hit_fs": disk / elig, "miss": (elig - loaded_total) / elig,
        "hit_other": (loaded_total - host - disk) / elig,
        "alloc_failures": res["alloc_failures"],
        "disk_per_logical": d["bytes"] / logical if logical else None,
        "disk_alloc_per_logical": d["alloc_bytes"] / logical if logical else None,
        "disk_mib": d["bytes"] / 2 ** 20, "chunk_files": d["chunk_files"], "dirs": d["dirs"],
        "stored_chunks": res["stored_chunks"],
        "wrong_kv": res["wrong_kv"], "verified": res["verified"],
        "gc_collections": res["gc"]["collections"], "gc_total_ms": res["gc"]["total_ms"],
        "gc_max_ms": res["gc"]["max_ms"],
        "wall_s": res["wall_s"], "build_s": res["build_s"], "shutdown_s": res["shutdown_s"],
    }
    s["per_kind_us_per_step"] = {k: res["ns"][k] / 1e3 / n_steps for k in KINDS}
    ms = res["mstats"]
    for _, name in MANAGER_COUNTERS:
        s[name] = ms["counters"].get(name, 0)
    s["ring_depth_max"] = ms["gauge_max"].get(RING_DEPTH)
    s["promo_job_ms_p50"] = pct([v * 1e3 for v in ms["promo_job_s"]], 50)
    s["promo_job_ms_p99"] = pct([v * 1e3 for v in ms["promo_job_s"]], 99)
    s["per_kind_cpu_us_per_step"] = {k: res["cpu_ns"][k] / 1e3 / n_steps for k in KINDS}
    s["per_kind_us_per_call"] = {k: (res["ns"][k] / 1e3 / res["calls"][k] if res["calls"][k] else None)
                                 for k in KINDS}
    s["calls_per_run"] = dict(res["calls"])
    # the slowest 1% of steps: what they spend their time on
    cut = pct(steps_us, 99)
    slow = [i for i, v in enumerate(steps_us) if v >= cut]
    s["slow_steps"] = len(slow)
    s["slow_kind_us"] = {k: sum(res["step_kinds"][i][j] for i in slow) / 1e3 / len(slow)
                         for j, k in enumerate(KINDS)}
    s["slow_lookups"] = sum(res["step_lookups"][i] for i in slow) / len(slow)
    s["all_lookups_per_step"] = sum(res["step_lookups"]) / n_steps
    s["lookup_results"] = res["lookup_results"]
    s["worker_rss_anon_mib"] = res["worker_rss_anon_mib"]
    s["worker_restarts"] = res["worker_restarts"]
    return s


def med_range(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def fmt(mr, digits):
    if mr is None:
        return "-"
    m, lo, hi = mr
    if lo == hi:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


ROWS = [  # (label, key, digits, ratio?)
    ("scheduler-thread time per step", None, 0, False),
    ("  p50 µs", "step_us_p50", 1, True),
    ("  p90 µs", "step_us_p90", 1, True),
    ("  p99 µs", "step_us_p99", 1, True),
    ("  max µs", "step_us_max", 0, True),
    ("  mean µs", "step_us_mean", 1, True),
    ("  total over run ms", "manager_ms_total", 0, True),
    ("  on-CPU part (thread_time around the same calls)", None, 0, False),
    ("    p50 µs", "step_cpu_us_p50", 1, True),
    ("    p99 µs", "step_cpu_us_p99", 1, True),
    ("    max µs", "step_cpu_us_max", 0, True),
    ("    mean µs", "step_cpu_us_mean", 1, True),
    ("    p99 of (wall - CPU) µs: descheduled/waiting", "offcpu_us_p99", 1, True),
    ("  steps", "steps", 0, False),
    ("  drain steps", "drain_steps", 0, False),
    ("CPU over the run (s)", None, 0, False),
    ("  scheduler process", "cpu_s", 2, True),
    ("    main thread", "main_thread_cpu_s", 2, True),
    ("    other threads (tier I/O)", "other_threads_cpu_s", 2, True),
    ("    of which driver row fill", "fill_cpu_s", 2, False),
    ("    process minus fill", "cpu_excl_fill_s", 2, True),
    ("    kernel (sys) part", "sys_cpu_s", 2, True),
    ("    voluntary context switches", "vol_ctx_switches", 0, True),
    ("    involuntary context switches", "invol_ctx_switches", 0, True),
    ("  tier worker processes", "workers_cpu_s", 2, False),
    ("promotion (first RETRY/HIT_PENDING -> HIT, per key)", None, 0, False),
    ("  promoted keys", "promo_n", 0, False),
    ("  p50 steps", "promo_steps_p50", 0, True),
    ("  p99 steps", "promo_steps_p99", 0, True),
    ("  p50 ms", "promo_ms_p50", 1, True),
    ("  p99 ms", "promo_ms_p99", 1, True),
    ("  max ms", "promo_ms_max", 1, True),
    ("  probed keys that resolved MISS", "probe_miss_n", 0, True),
    ("  manager's own histogram: promotion job p50 ms", "promo_job_ms_p50", 1, True),
    ("  manager's own histogram: promotion job p99 ms", "promo_job_ms_p99", 1, True),
    ("deferral (steps a request waited on HIT_PENDING/RETRY)", None, 0, False),
    ("  mean", "defer_mean", 2, True),
    ("  p50", "defer_p50", 0, False),
    ("  p99", "defer_p99", 0, True),
    ("  max", "defer_max", 0, True),
    ("  requests deferred at least once", "deferred_frac", 3, True),
    ("  arrival -> admitted p50 steps", "queue_p50", 0, False),
    ("  arrival -> admitted p99 steps", "queue_p99", 0, True),
    ("lookups", None, 0, False),
    ("  calls per run", "lookups", 0, True),
    ("  per step", "lookups_per_step", 1, True),
    ("  per loaded chunk", "lookups_per_loaded_chunk", 2, True),
    ("  share answered HIT_PENDING/RETRY", "pending_frac", 3, True),
    ("hits (share of chunks after the GPU prefix cache)", None, 0, False),
    ("  CPU tier", "hit_cpu", 3, True),
    ("  fs tier", "hit_fs", 3, True),
    ("  recomputed", "miss", 3, True),
    ("  prepare_store -> None (no room)", "alloc_failures", 0, False),
    ("manager's own counters over the run (get_stats)", None, 0, False),
    *[(f"  {lbl}", name, 0, False) for lbl, name in MANAGER_COUNTERS],
    ("  shmtier job ring depth, max seen", "ring_depth_max", 0, False),
    ("disk", None, 0, False),
    ("  bytes per logical byte", "disk_per_logical", 3, True),
    ("  allocated bytes per logical byte", "disk_alloc_per_logical", 3, True),
    ("  MiB on disk", "disk_mib", 0, True),
    ("  chunk files", "chunk_files", 0, True),
    ("  directories", "dirs", 0, True),
    ("rows checked at load", "verified", 0, False),
    ("  wrong KV served", "wrong_kv", 0, False),
    ("GC in this process during the run (heap frozen first)", None, 0, False),
    ("  collections", "gc_collections", 0, True),
    ("  total ms", "gc_total_ms", 1, True),
    ("  longest ms", "gc_max_ms", 2, True),
    ("wall s (run)", "wall_s", 1, True),
    ("  build s", "build_s", 2, False),
    ("  shutdown s", "shutdown_s", 2, False),
]


def print_table(sums: dict, names: list) -> None:
    w = 26
    others = [n for n in names if n != "vllm"] if "vllm" in names else []
    head = f"{'':<52}" + "".join(f"{label(n):>{w}}" for n in names)
    for n in others:
        head += f"{label(n)[:10] + '/vLLM':>16}"
    print(head)
    for row_label, key, digits, ratio in ROWS:
        if key is None:
            print(row_label)
            continue
        line = f"{row_label:<52}"
        meds = {}
        for n in names:
            mr = med_range([s[key] for s in sums[n]])
            meds[n] = mr[0] if mr else None
            line += f"{fmt(mr, digits):>{w}}"
        for n in others:
            if ratio and meds.get("vllm") and meds.get(n) is not None:
                line += f"{meds[n] / meds['vllm']:>15.2f}x"
            else:
                line += f"{'':>16}"
        print(line)


def print_kinds(sums: dict, names: list) -> None:
    print("\nwhere the scheduler-thread time goes (median over runs): wall µs per step, on-CPU µs "
          "per step, calls per run, wall µs per call")
    head = f"{'call':<20}"
    for n in names:
        head += f"  {label(n) + ' wall/step':>19}{'cpu/step':>9}{'calls':>7}{'µs/call':>8}"
    print(head)
    for kind in KINDS:
        line = f"{kind:<20}"
        for n in names:
            per_step = statistics.median(s["per_kind_us_per_step"][kind] for s in sums[n])
            cpu = statistics.median(s["per_kind_cpu_us_per_step"][kind] for s in sums[n])
            ncalls = statistics.median(s["calls_per_run"][kind] for s in sums[n])
            per_call = [s["per_kind_us_per_call"][kind] for s in sums[n]
                        if s["per_kind_us_per_call"][kind] is not None]
            pc_txt = f"{statistics.median(per_call):.2f}" if per_call else "-"
            line += f"  {per_step:>19.1f}{cpu:>9.1f}{ncalls:>7.0f}{pc_txt:>8}"
        print(line)
    print("\nthe slowest 1% of steps (wall >= p99): mean wall µs per kind in those steps vs over all steps")
    head = f"{'call':<20}"
    for n in names:
        head += f"  {label(n) + ' slow steps':>22}{'all':>8}"
    print(head)
    for kind in KINDS:
        line = f"{kind:<20}"
        for n in names:
            slow = statistics.median(s["slow_kind_us"][kind] for s in sums[n])
            every = statistics.median(s["per_kind_us_per_step"][kind] for s in sums[n])
            line += f"  {slow:>22.1f}{every:>8.1f}"
        print(line)
    line = f"{'(lookup calls/step)':<20}"
    for n in names:
        slow = statistics.median(s["slow_lookups"] for s in sums[n])
        every = statistics.median(s["all_lookups_per_step"] for s in sums[n])
        line += f"  {slow:>22.1f}{every:>8.1f}"
    print(line)


# --------------------------------------------------------------------------- main


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
    compression: str = "auto"
    direct_io: bool | str = False
    drain_timeout_s: float = 60.0
    max_extra_steps: int = 20_000


def make_data_pool(chunk_bytes: int, n: int, seed: int) -> np.ndarray:
    """``n`` chunks of bf16-like data: the high 16 bits of random-normal float32."""
    rng = np.random.default_rng(seed)
    f = rng.standard_normal(n * chunk_bytes // 2, dtype=np.float32)
    bf16 = (f.view(np.uint32) >> 16).astype(np.uint16)
    return bf16.view(np.uint8).reshape(n, chunk_bytes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs per manager, interleaved")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 1 small run per manager (< 60 s with vLLM's import)")
    ap.add_argument("--managers", default="shmtier,vllm",
                    help="comma-separated: shmtier, vllm, and shmtier@TOKENS variants, TOKENS "
                         "'+'-joined worker scheduling (--worker-sched values) and/or compression "
                         "(raw = none, zstd), e.g. shmtier,shmtier@nice0,shmtier@raw,vllm; all "
                         "interleaved")
    ap.add_argument("--chunk-kib", type=int, default=256, help="chunk (arena row) KiB, page multiple")
    ap.add_argument("--cpu-mib", type=int, default=128, help="CPU tier MiB (both managers)")
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--requests", type=int, default=900)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--arrival-rate", type=float, default=1.0, help="requests per step")
    ap.add_argument("--step-ms", type=float, default=5.0,
                    help="engine step period: the simulated forward pass sleeps the rest")
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help="chunks a running request offers per step")
    ap.add_argument("--workers", type=int, default=2, help="shmtier num_tier_workers")
    ap.add_argument("--worker-sched", default="default",
                    choices=tuple(WORKER_SCHED),
                    help="experiment: scheduling policy / niceness set on shmtier's tier workers "
                         "after they start (default: leave them as spawned)")
    ap.add_argument("--compression", default="auto", choices=("auto", "zstd", "none"),
                    help="shmtier's compression mode (default: its default, auto)")
    ap.add_argument("--fs-direct-io", default="off", choices=("auto", "on", "off"),
                    help="shmtier's fs tier direct_io (off: buffered, the default; on: "
                         "O_DIRECT; auto: O_DIRECT where the filesystem takes it)")
    ap.add_argument("--dir", default=None, help="parent of the fs tiers' temp dirs (default: system tmp)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--target", type=float, default=0.5,
                    help="target: shmtier step p99 <= target x vLLM's")
    ap.add_argument("--json", metavar="PATH", help="write every run's figures as JSON")
    ap.add_argument("--profile", default=None, metavar="MANAGER",
                    help="cProfile one run of this manager (driver thread) instead of the bench")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 1
        args.conversations = min(args.conversations, 80)
        args.requests = min(args.requests, 200)
        args.cpu_mib = min(args.cpu_mib, 32)
        args.step_ms = min(args.step_ms, 3.0)
    names = [n.strip() for n in args.managers.split(",") if n.strip()]
    for n in names + ([args.profile] if args.profile else []):
        base, at, variant = n.partition("@")
        tokens = variant.split("+") if at else []
        if base not in MAKERS or (at and (base != "shmtier" or not all(
                t in WORKER_SCHED or t in ("raw", "zstd") for t in tokens))):
            ap.error(f"unknown manager {n!r} (shmtier, vllm, or shmtier@TOKENS with "
                     f"TOKENS '+'-joined from {', '.join(WORKER_SCHED)}, raw, zstd)")
    if len(set(names)) != len(names):
        ap.error("--managers: a manager is listed twice")
    chunk_bytes = args.chunk_kib * 1024
    if chunk_bytes % 4096:
        ap.error("--chunk-kib must be a multiple of 4")
    cfg = Config(chunk_bytes=chunk_bytes, cpu_bytes=args.cpu_mib << 20, step_ms=args.step_ms,
                 max_running=args.max_running, batch=args.batch, workers=args.workers,
                 dir=args.dir or tempfile.gettempdir(), worker_sched=args.worker_sched,
                 compression=args.compression,
                 direct_io={"auto": "auto", "on": True, "off": False}[args.fs_direct_io])

    def _exit(signum, _frame):
        sys.exit(128 + signum)  # unwinds through the finally blocks: managers, dirs, /dev/shm

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)

    vllm_note = ""
    if "vllm" in names or args.profile == "vllm":
        t0 = time.perf_counter()
        try:
            import vllm
            import vllm.v1.kv_offload.tiering.manager  # noqa: F401 - fail here, not mid-run
            vllm_note = f"vLLM {vllm.__version__} imported in {time.perf_counter() - t0:.1f} s (not timed)"
            try:
                import vllm.fs_io_C  # noqa: F401
                vllm_note += "; its fs tier uses the fs_io_C extension"
            except Exception as e:  # noqa: BLE001
                vllm_note += (f"; fs_io_C not importable here ({type(e).__name__}), so its fs tier "
                              f"runs its pure-Python I/O path")
        except Exception as e:  # noqa: BLE001
            if "vllm" in names:
                names.remove("vllm")
            vllm_note = f"vLLM NOT importable ({type(e).__name__}: {e}): shmtier measured alone"

    t0 = time.perf_counter()
    trace = bench_trace.make_trace(bench_trace.TraceParams(
        conversations=args.conversations, requests=args.requests, zipf=args.zipf,
        arrival_rate=args.arrival_rate, seed=args.seed))
    gen_s = time.perf_counter() - t0
    capacity = cfg.cpu_bytes // chunk_bytes
    data_pool = make_data_pool(chunk_bytes, 16, args.seed)

    if args.profile:
        if args.profile == "vllm" and vllm_note.startswith("vLLM NOT"):
            print(f"cannot profile vllm: {vllm_note}")
            return 2
        prof = cProfile.Profile()
        res = run_one(args.profile, trace, cfg, data_pool, 0, prof)
        s = summarise(res, chunk_bytes)
        print(f"cProfile of one {label(args.profile)} run (driver thread only; "
              f"{trace.describe(capacity)}): step p50 {s['step_us_p50']:.0f} µs, "
              f"p99 {s['step_us_p99']:.0f} µs under the profiler")
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumulative").print_stats(45)
        return 0

    print("shmtier bench: tiering_steps - scheduler-side cost per engine step, shmtier vs "
          "vLLM 0.33 tiering with an fs tier")
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs "
          f"(shared, noisy: read medians, mind the spreads), load avg {os.getloadavg()[0]:.2f} "
          f"at start; {vllm_note or 'vLLM not requested'}")
    print("method:")
    print(f"  trace (bench/trace.py, seed {args.seed}, generated in {gen_s:.2f} s, the same for "
          f"every run): {trace.describe(capacity)}")
    print(f"  sizes: chunk {args.chunk_kib} KiB (= arena row, no padding), CPU tier "
          f"{args.cpu_mib} MiB = {capacity} chunks for both managers, LRU, events off; fs tier "
          f"unbounded, fresh temp dir under {cfg.dir} per run (removed after)")
    print(f"  shmtier: TieringOffloadingSpec(...).get_manager(), fs tier, num_tier_workers "
          f"{args.workers} (spawned processes; scheduling {args.worker_sched}: "
          f"{WORKER_SCHED[args.worker_sched]}), compression {args.compression}, direct_io {args.fs_direct_io}, min_free_bytes None;"
          f" variants shmtier@TOKENS override scheduling / compression (raw = none)")
    print("  vLLM: TieringOffloadingManager(CPUPrimaryTierOffloadingManager(SharedOffloadRegion),"
          " [FileSystemTierManager]) built from its classes, fs tier defaults (16+16 I/O threads,"
          " O_DIRECT if the dir allows it, async lookup thread), no backpressure on either side")
    print(f"  driver = the connector's scheduler half (contract §2.3), one step every "
          f"{args.step_ms:g} ms: admit waiting requests (up to {args.max_running} running): "
          "on_new_request once, lookup scan")
    print("    after the GPU-cached chunks until MISS (HIT_PENDING/RETRY defer to the next step, "
          "RETRY does not stop the scan),")
    print("    hits (capped so one chunk is computed) -> prepare_load + get_load_source per key; "
          f"running requests offer their next {args.batch} chunks")
    print("    to prepare_store (rows then filled with bf16-like random data + the key in the "
          "first 16 bytes, checked at every load);")
    print("    finished -> on_request_finished; on_schedule_end; sleep out the step (forward "
          "pass); complete_store/complete_load for")
    print("    jobs prepared the step before; has_pending_work, get_stats, list(take_events()). "
          "After the trace: idle steps until")
    print("    has_pending_work() is False (drain, not in the step figures).")
    print("  timed: every manager call with perf_counter_ns, and thread_time_ns for its on-CPU part "
          "(a request's lookup scan as one region);")
    print("    per step the sum = scheduler-thread time. The managers' own get_stats payloads are "
          "folded (untimed) for their counters.")
    print("  CPU: time.process_time/thread_time and getrusage of this process over trace + "
          "drain (the driver's row fill is the simulated GPU")
    print("    copy, listed apart); shmtier's tier workers from /proc/<pid>/stat (utime+stime).")
    print("  promotion latency: per (request, key), first lookup answering RETRY or HIT_PENDING "
          "(not for a store the driver has in flight) to its first HIT.")
    print("  hits: loaded chunks by get_load_source (host = CPU tier, disk = fs tier) over the "
          "chunks after the GPU-cached ones of admitted requests.")
    print("  disk: chunk files' st_size (and st_blocks) / (files x chunk bytes) after the drain.")
    print(f"  repeats: {args.repeats} per manager, interleaved (order rotated per run); before "
          "each run gc.collect() + gc.freeze() (as vLLM's engine core")
    print("    does after init), gc on; table: median [min-max] over runs, ratio of medians.")

    sums = {n: [] for n in names}
    raws = {n: [] for n in names}
    run_no = 0
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            run_no += 1
            res = run_one(n, trace, cfg, data_pool, run_no)
            s = summarise(res, chunk_bytes)
            sums[n].append(s)
            raws[n].append({k: v for k, v in res.items()
                            if k not in ("step_ns", "step_cpu_ns", "step_kinds", "step_lookups")})
            print(f"  run {r + 1}/{args.repeats} {label(n):>14}: {s['steps']} steps, step p50 "
                  f"{s['step_us_p50']:.0f} µs p99 {s['step_us_p99']:.0f} µs, promotion p50 "
                  f"{s['promo_ms_p50'] or 0:.0f} ms, deferral p99 {s['defer_p99']} steps, process CPU "
                  f"{s['cpu_s']:.2f} s, wall {s['wall_s']:.1f} s, load avg {os.getloadavg()[0]:.2f}"
                  + (f", workers {'; '.join(res['worker_sched'])}" if res.get("worker_sched") else ""),
                  flush=True)

    print("\n=== results: median [min-max] over runs ===")
    print_table(sums, names)
    print_kinds(sums, names)
    for n in names:
        rss = [x for s in sums[n] for x in (s["worker_rss_anon_mib"] or []) if x is not None]
        if rss:
            restarts = [s["worker_restarts"] for s in sums[n]]
            print(f"\n{label(n)} tier workers: private RSS (RssAnon) at end {min(rss):.0f}-"
                  f"{max(rss):.0f} MiB each; restarts {restarts}")
    print("lookup answers (first run): " + "; ".join(
        f"{label(n)} {sums[n][0]['lookup_results']}" for n in names))
    wrong = {n: sum(s["wrong_kv"] for s in sums[n]) for n in names}
    print("wrong KV served (row stamp mismatch at load): " + ", ".join(
        f"{label(n)} {wrong[n]} of {sum(s['verified'] for s in sums[n])}" for n in names))

    if "vllm" in names:
        p99 = {n: statistics.median(s["step_us_p99"] for s in sums[n]) for n in names}
        p50 = {n: statistics.median(s["step_us_p50"] for s in sums[n]) for n in names}
        for n in names:
            if n == "vllm":
                continue
            paired = [a["step_us_p99"] / b["step_us_p99"] for a, b in zip(sums[n], sums["vllm"])]
            ratio = p99[n] / p99["vllm"]
            print(f"\nstep time {label(n)}/vLLM: p50 {p50[n] / p50['vllm']:.2f}x, p99 {ratio:.2f}x "
                  f"(per run pair: {', '.join(f'{x:.2f}' for x in paired)})")
            met = ratio <= args.target
            print(f"target ({label(n)} step p99 <= {args.target:g} x vLLM's, same trace): "
                  f"{'MET' if met else 'NOT MET'} ({p99[n]:.0f} µs vs {p99['vllm']:.0f} µs; "
                  f"{sum(1 for x in paired if x <= args.target)} of {len(paired)} run pairs within)")
    print(f"load avg at end {os.getloadavg()[0]:.2f}")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"bench": "tiering_steps", "args": vars(args), "vllm": vllm_note,
                       "trace": trace.summary(), "summaries": sums, "runs": raws}, f, indent=1,
                      default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
