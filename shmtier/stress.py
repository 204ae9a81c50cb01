"""``shmtier run`` (what ``scripts/run`` runs): a short multi-turn stress run.

One process plays the scheduler and a GPU rank (CPU tensors stand in for the
GPU KV cache); the spec spawns the tier worker processes that cascade chunks
to an ``fs`` tier in a temporary directory and promote them back. Each step
follows the connector's order (docs/vllm-contract.md §2.3): look the request's prefix up
(HIT_PENDING / RETRY defer it to a later step), load the hits, store the new
chunks, finish, ``on_schedule_end``. The CPU tier holds a fraction of the
working set, so later turns find their prefix on disk. At the end every
loaded chunk has been compared byte for byte with what was offloaded.

Chaos (``Chaos``; the CLI's ``--kill-workers-every``, ``--delete-namespace-at``,
``--delete-root-at``): SIGKILL a random healthy tier worker at random intervals
(the pool restarts it), remove the fs tier's namespace directory (everything under the
root), or remove the root itself and make it again a moment later, at fractions of the
trace. At the end, whatever the options, the tiers settle (no pending work) and the run
checks: no wrong byte served; the fs tier's ``bytes_on_disk`` gauge equals the sum of
the ``*.kv`` files under the root; every file is indexed and every indexed chunk has
its file, of the size indexed (no orphan either way); then, after shutdown, a fresh
engine on the same root lists it at start-up and the same holds for its index (and no
temp file is left after that scan).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from shmtier.config import KVLayout
from shmtier.contract import GPULoadStoreSpec, LookupResult, ReqContext, ScheduleEndContext
from shmtier.tiers.fs import scheduler as fs_tier
from shmtier.spec import TieringOffloadingSpec

HIT, MISS = LookupResult.HIT, LookupResult.MISS
PAGE = 64 << 10  # bytes of one GPU block (one rank); bf16 KV of a small model


@dataclass
class _Conversation:
    cid: int
    chunks: int = 0
    turns_done: int = 0


@dataclass
class _Totals:
    steps: int = 0
    step_us: list = field(default_factory=list)
    deferred_steps: int = 0
    lookups_hit_cpu: int = 0
    lookups_promoted: int = 0
    chunks_computed: int = 0
    chunks_loaded: int = 0
    store_refused: int = 0
    exact: bool = True
    wrong_bytes: int = 0  # loaded bytes that differ from what was offloaded
    counters: dict = field(default_factory=dict)  # totals of _COUNTED over the run


def _keys(cid: int, n: int) -> list[bytes]:
    keys, parent = [], f"conv{cid}".encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        keys.append(parent + b"\0\0\0\0")
    return keys


def _content(key: bytes) -> np.ndarray:
    """Deterministic bf16-like KV bytes of one chunk (random normal, top 16 bits)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return (rng.standard_normal(PAGE // 2, dtype=np.float32).view(np.uint32) >> 16).astype(
        np.uint16).view(np.uint8)


@dataclass(frozen=True)
class Chaos:
    """What ``run_stress`` does to the tiers while the trace plays."""

    kill_every_s: float | None = None  # mean seconds between SIGKILLs of a tier worker
    delete_namespace_at: tuple[float, ...] = ()  # fractions of the trace: rm -r root/*
    delete_root_at: tuple[float, ...] = ()  # fractions of the trace: rm -r root ...
    root_gone_s: float = 1.0  # ... and mkdir root this many seconds later


class _ChaosRunner:
    """Applies a ``Chaos`` from the scheduler thread, between manager calls."""

    def __init__(self, chaos: Chaos, rng, pool, engine_id: str, root: str, requests: int):
        self.chaos, self.rng, self.pool, self.engine_id, self.root = (
            chaos, rng, pool, engine_id, root)
        self.kill_at = self._next_kill(time.monotonic())
        self.deletions = sorted([(int(f * requests), "namespace") for f in chaos.delete_namespace_at]
                                + [(int(f * requests), "root") for f in chaos.delete_root_at])
        self.recreate_at: float | None = None
        self.kills = self.no_worker_to_kill = self.namespace_deletions = self.root_deletions = 0
        self.files_deleted = self.rm_retries = 0

    def _next_kill(self, now: float) -> float:
        every = self.chaos.kill_every_s
        return now + every * self.rng.uniform(0.5, 1.5) if every else math.inf

    def tick(self, request_no: int) -> None:
        now = time.monotonic()
        if self.recreate_at is not None and now >= self.recreate_at:
            self._recreate_root()
        while self.deletions and self.deletions[0][0] <= request_no:
            self._delete(self.deletions.pop(0)[1])
        if now >= self.kill_at:
            self.kill_at = self._next_kill(now) if self._kill() else now + 0.05

    def stop(self) -> None:
        """No more chaos: the root exists again, no more kills."""
        self.kill_at = math.inf
        if self.recreate_at is not None:
            self._recreate_root()

    def _kill(self) -> bool:
        live = self.pool.healthy_workers() if self.pool is not None else []
        if not live:
            self.no_worker_to_kill += 1
            return False
        _, pid = live[int(self.rng.integers(len(live)))]
        try:  # the pool's record names our own child: check its command line anyway
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"shmtier.workers.job_loop" not in argv or self.engine_id.encode() not in argv:
                return False
            os.kill(pid, signal.SIGKILL)
        except OSError:
            return False
        self.kills += 1
        return True

    def _delete(self, what: str) -> None:
        self.files_deleted += sum(len([n for n in names if n.endswith(".kv")])
                                  for _, _, names in os.walk(self.root))
        if what == "root":
            self.root_deletions += 1
            for attempt in range(20):
                shutil.rmtree(self.root, ignore_errors=True)
                if not os.path.exists(self.root):
                    break
                self.rm_retries += 1
            self.recreate_at = time.monotonic() + self.chaos.root_gone_s
            return
        self.namespace_deletions += 1
        # rm -r racing the workers' writes can leave a directory (ENOTEMPTY): then the
        # namespace is still the same directory, with files gone under it, which the
        # tier does not detect (see bench/README.md). Remove it as an operator would,
        # again until it is gone.
        for attempt in range(20):
            for name in os.listdir(self.root):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            if not os.listdir(self.root):
                break
            self.rm_retries += 1

    def _recreate_root(self) -> None:
        self.recreate_at = None
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def report(self) -> str:
        return (f"chaos: {self.kills} tier workers SIGKILLed"
                f"{f' ({self.no_worker_to_kill} times none was healthy)' if self.no_worker_to_kill else ''}, "
                f"namespace deleted {self.namespace_deletions}x, root deleted and recreated "
                f"{self.root_deletions}x ({self.files_deleted} chunk files deleted, rm -r "
                f"repeated {self.rm_retries}x)")


def run_stress(conversations: int = 24, turns: int = 4, chunks_per_turn: int = 4,
               cpu_chunks: int = 48, workers: int = 2, seed: int = 0,
               settle_each: bool = False, chaos: Chaos | None = None,
               max_bytes: int | None = None) -> int:
    """``settle_each``: after every request wait until the tiers are idle (each
    cascade written before the next request: deterministic hit counts, for tests).
    ``chaos``: kill tier workers and delete the fs root while the trace plays.
    ``max_bytes``: the fs tier's bound. Returns 0 when every check passed."""
    import torch

    from shmtier.gpu.canonical import CanonicalKVCacheRef, CanonicalKVCaches

    rng = np.random.default_rng(seed)
    root = tempfile.mkdtemp(prefix="shmtier-run-")
    layout = KVLayout("stress-model", "bfloat16", 16, PAGE, 1)
    extra = {"cpu_bytes_to_use": cpu_chunks * PAGE, "num_tier_workers": workers,
             "secondary_tiers": [{"type": "fs", "root_dir": root, "min_free_bytes": None,
                                  "max_bytes": max_bytes}]}
    engine_id = f"run-{uuid.uuid4().hex[:8]}"
    spec = TieringOffloadingSpec(extra, layout, engine_id)
    max_chunks = turns * chunks_per_turn
    gpu = torch.zeros((2 * max_chunks, PAGE), dtype=torch.int8)
    manager = spec.get_manager()
    worker = None
    totals = _Totals()
    end = ScheduleEndContext((), ())
    jobs = iter(range(1, 1 << 30))
    checks: list[tuple[str, bool]] = []
    try:
        worker = spec.get_worker(CanonicalKVCaches([gpu], [[CanonicalKVCacheRef(0, PAGE)]]), 0)
        _settle(manager, end)  # tier workers up and the (empty) fs root listed
        fs = next(t for t in manager.tiers if isinstance(t, fs_tier.FsTierManager))
        started = time.monotonic()
        print(f"shmtier run: engine {engine_id}, CPU tier {cpu_chunks} chunks x {PAGE >> 10} KiB, "
              f"fs tier in {root}, {workers} tier workers")
        convs = [_Conversation(c) for c in range(conversations)]
        queue = [c for _ in range(turns) for c in rng.permutation(conversations).tolist()]
        print(f"  {conversations} conversations x {turns} turns, +{chunks_per_turn} chunks "
              f"per turn: {len(queue)} requests, working set "
              f"{conversations * max_chunks / cpu_chunks:.1f}x the CPU tier"
              f"{f', fs max_bytes {max_bytes}' if max_bytes is not None else ''}")
        runner = _ChaosRunner(chaos or Chaos(), rng, spec.worker_pool, engine_id, root, len(queue))
        if chaos is not None:
            print(f"  chaos (seed {seed}): {chaos}")
        for n, cid in enumerate(queue):
            runner.tick(n)
            conv = convs[cid]
            keys = _keys(cid, conv.chunks + chunks_per_turn)
            ctx = ReqContext(f"req{n}")
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, (i + 1) * 16)
            timer = _StepTimer(totals)
            with manager.lock:
                timer(manager.on_new_request, ctx)
            while True:  # lookup pass, repeated each step while deferred
                hits, deferred = 0, False
                with manager.lock:
                    for k in keys[: conv.chunks]:
                        result = timer(manager.lookup, k, ctx)
                        if result is HIT:
                            hits += 1 if not deferred else 0
                            continue
                        if result is MISS:
                            break
                        deferred = True
                    if deferred:
                        timer(manager.on_schedule_end, end)
                if not deferred:
                    break
                totals.deferred_steps += 1
                timer.close_step()
                time.sleep(0.001)
                runner.tick(n)
            hit_keys = keys[:hits]
            with manager.lock:
                if hit_keys:
                    sources = [manager.get_load_source(k, ctx).value for k in hit_keys]
                    totals.lookups_hit_cpu += sources.count("host")
                    totals.lookups_promoted += len(hit_keys) - sources.count("host")
                    load = timer(manager.prepare_load, hit_keys, ctx)
                new = keys[hits:]
                out = timer(manager.prepare_store, keys, ctx)
                if out is None:
                    totals.store_refused += len(new)
            if hit_keys:
                blocks = list(range(len(hit_keys)))
                gpu[blocks] = 0
                _copy(worker, "load", next(jobs), load, blocks)
                for b, k in zip(blocks, hit_keys):
                    wrong = int(np.count_nonzero(gpu[b].numpy().view(np.uint8) != _content(k)))
                    totals.wrong_bytes += wrong
                    totals.exact &= wrong == 0
                totals.chunks_loaded += len(hit_keys)
            totals.chunks_computed += len(new)
            if out is not None and out.keys_to_store:
                blocks = list(range(max_chunks, max_chunks + len(out.keys_to_store)))
                for b, k in zip(blocks, out.keys_to_store):
                    gpu[b] = torch.from_numpy(_content(k).view(np.int8))
                _copy(worker, "store", next(jobs), out.store_spec, blocks)
            with manager.lock:
                if hit_keys:
                    timer(manager.complete_load, hit_keys, ctx)
                if out is not None and out.keys_to_store:
                    timer(manager.complete_store, out.keys_to_store, ctx)
                timer(manager.on_request_finished, ctx)
                timer(manager.on_schedule_end, end)
                stats = timer(manager.get_stats)
                timer(manager.take_events)
            timer.close_step()
            _accumulate(totals, stats)
            conv.chunks += chunks_per_turn
            if settle_each:
                _settle(manager, end)
        runner.stop()
        settled = _settle(manager, end, timeout_s=60.0)
        with manager.lock:
            stats = manager.get_stats()
            _accumulate(totals, stats)
            gauge = sum(stats.data["data"].get(fs_tier.BYTES_ON_DISK, {}).values())
            indexed = fs.indexed_chunks()
        _report(totals, time.monotonic() - started)
        if chaos is not None:
            print(runner.report())
            print(f"fs tier: {fs.namespace_resets} results flagged NAMESPACE_RESET "
                  f"(the index dropped and the root listed again)")
        print("checks")
        checks.append(("no wrong byte served", _line(
            f"wrong bytes served: {totals.wrong_bytes} in {totals.chunks_loaded} loaded chunks",
            totals.wrong_bytes == 0 and totals.exact)))
        checks.append(("tiers settled", _line(
            f"tiers settled (no pending work) after the trace: {'yes' if settled else 'NO'}",
            settled)))
        checks += _check_index(root, "live engine", indexed, gauge, max_bytes)
    finally:
        if worker is not None:
            worker.shutdown()
        manager.shutdown()
        if checks:  # the trace ran: a fresh engine lists the same root
            try:
                checks += _fresh_scan(extra, layout, root, max_bytes)
            except Exception as e:  # a check that cannot run fails
                checks.append(("fresh engine's scan", _line(f"fresh engine's scan: {e!r}", False)))
        shutil.rmtree(root, ignore_errors=True)
    left = [e for e in os.listdir("/dev/shm") if engine_id in e]
    print(f"segment and ring semaphores removed on shutdown: {'yes' if not left else left}")
    failed = [name for name, ok in checks if not ok]
    print(f"all checks passed: {'yes' if not failed and not left else 'NO: ' + ', '.join(failed)}")
    return 0 if totals.exact and not left and checks and not failed else 1


def _line(text: str, ok: bool) -> bool:
    print(f"  [{'ok' if ok else 'FAIL'}] {text}")
    return ok


def _files(root: str) -> tuple[dict[bytes, int], int]:
    """The ``*.kv`` chunk files under ``root`` (key -> size) and the number of temp files."""
    from shmtier.tiers.fs.namespace import chunk_key

    files, temps = {}, 0
    for where, _, names in os.walk(root):
        for name in names:
            key = chunk_key(name) if name.endswith(".kv") else None
            if key is not None:
                files[key] = os.lstat(os.path.join(where, name)).st_size
            elif name.endswith(".tmp"):
                temps += 1
    return files, temps


def _check_index(root: str, who: str, indexed: dict[bytes, int], gauge: int,
                 max_bytes: int | None, temps_allowed: bool = True) -> list[tuple[str, bool]]:
    """The fs index (and its bytes gauge) against the files on disk."""
    files, temps = _files(root)
    on_disk = sum(files.values())
    orphans = files.keys() - indexed.keys()
    missing = indexed.keys() - files.keys()
    sized = [k for k in files.keys() & indexed.keys() if files[k] != indexed[k]]
    out = [(f"{who}: bytes", _line(
        f"{who}: fs bytes_on_disk gauge {gauge} vs *.kv files {on_disk} "
        f"({len(files)} files, {len(indexed)} indexed): diff {gauge - on_disk:+d}",
        gauge == on_disk))]
    out.append((f"{who}: orphans", _line(
        f"{who}: orphan files (on disk, not indexed): {len(orphans)} "
        f"({sum(files[k] for k in orphans)} bytes)", not orphans)))
    out.append((f"{who}: missing files", _line(
        f"{who}: indexed chunks without a file: {len(missing)}; size differs: {len(sized)}",
        not missing and not sized)))
    if max_bytes is not None:
        out.append((f"{who}: max_bytes", _line(
            f"{who}: files within max_bytes: {on_disk} <= {max_bytes}", on_disk <= max_bytes)))
    out.append((f"{who}: temp files", _line(f"{who}: temp files left: {temps}",
                                            temps_allowed or temps == 0)))
    return out


def _fresh_scan(extra: dict, layout: KVLayout, root: str,
                max_bytes: int | None) -> list[tuple[str, bool]]:
    """After shutdown: a second engine on the same root lists it at start-up; its index
    must be exactly the files (and the scan removes dead writers' temp files)."""
    spec = TieringOffloadingSpec(extra, layout, f"run-{uuid.uuid4().hex[:8]}")
    manager = spec.get_manager()
    try:
        end = ScheduleEndContext((), ())
        settled = _settle(manager, end)
        with manager.lock:
            stats = manager.get_stats()
            gauge = sum(stats.data["data"].get(fs_tier.BYTES_ON_DISK, {}).values())
            fs = next(t for t in manager.tiers if isinstance(t, fs_tier.FsTierManager))
            indexed = fs.indexed_chunks()
        out = [("fresh engine settled", _line(
            f"fresh engine on the same root: start-up scan done: {'yes' if settled else 'NO'}",
            settled))]
        return out + _check_index(root, "fresh engine", indexed, gauge, max_bytes,
                                  temps_allowed=False)
    finally:
        manager.shutdown()
        left = [e for e in os.listdir("/dev/shm") if spec.engine_id in e]
        if left:
            print(f"  [FAIL] fresh engine left {left} in /dev/shm")


def _settle(manager, end, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with manager.lock:
            manager.on_schedule_end(end)
            if not manager.has_pending_work():
                return True
        time.sleep(0.002)
    return False


class _StepTimer:
    """Sums the time spent in manager calls for the current step."""

    def __init__(self, totals: _Totals):
        self.totals, self.spent = totals, 0.0

    def __call__(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.spent += time.perf_counter() - start

    def close_step(self) -> None:
        self.totals.steps += 1
        self.totals.step_us.append(self.spent * 1e6)
        self.spent = 0.0


_COUNTED = ("vllm:kv_offload_tiering_write_bytes", "vllm:kv_offload_tiering_read_bytes",
            fs_tier.STORED_RATIO, fs_tier.CORRUPT_CHUNKS, fs_tier.WORKER_RESTARTS)


def _accumulate(totals: _Totals, stats) -> None:
    data = stats.data["data"]
    sums = totals.counters
    for name in _COUNTED:
        for value in data.get(name, {}).values():
            sums[name] = sums.get(name, 0) + value


def _copy(worker, kind: str, job_id: int, cpu_spec, blocks: list[int]) -> None:
    gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
    if kind == "store":
        worker.submit_store(job_id, gpu, cpu_spec)
    else:
        worker.submit_load(job_id, cpu_spec, gpu)
    worker.wait({job_id})
    for result in worker.get_finished():
        if not result.success:
            raise RuntimeError(f"copy job {result.job_id} failed")


def _report(t: _Totals, elapsed: float) -> None:
    c = t.counters
    lookups = t.chunks_loaded + t.chunks_computed
    written = c.get("vllm:kv_offload_tiering_write_bytes", 0)
    stored = c.get(fs_tier.STORED_RATIO, 0)
    steps = np.array(t.step_us) if t.step_us else np.zeros(1)
    print(f"\nfinished in {elapsed:.1f} s, {t.steps} scheduler steps ({t.deferred_steps} deferred)")
    print("hit rates (chunks of the prompts)")
    print(f"  CPU tier   {t.lookups_hit_cpu:6d}  ({t.lookups_hit_cpu / max(lookups, 1):.0%})")
    print(f"  fs tier    {t.lookups_promoted:6d}  ({t.lookups_promoted / max(lookups, 1):.0%}, promoted)")
    print(f"  computed   {t.chunks_computed:6d}  ({t.chunks_computed / max(lookups, 1):.0%}; "
          f"{t.store_refused} of them not offloaded: no free CPU row)")
    print("bytes moved")
    print(f"  CPU -> fs (cascades)   {written / 2**20:8.1f} MiB logical, {stored / 2**20:.1f} MiB on disk"
          f" (compression {written / stored if stored else 1:.2f}x)")
    print(f"  fs -> CPU (promotions) {c.get('vllm:kv_offload_tiering_read_bytes', 0) / 2**20:8.1f} MiB")
    print(f"  checksum failures {c.get(fs_tier.CORRUPT_CHUNKS, 0)}, worker restarts "
          f"{c.get(fs_tier.WORKER_RESTARTS, 0)}")
    print("scheduler-thread time in manager calls per step (µs)")
    print(f"  p50 {np.percentile(steps, 50):.0f}   p99 {np.percentile(steps, 99):.0f}   "
          f"max {steps.max():.0f}")
    print(f"loaded chunks identical to what was offloaded: {'yes' if t.exact else 'NO'}"
          f" ({t.chunks_loaded} chunks)")
