"""The managers tiering_steps.py compares, built the same size with an fs tier.

``make_shmtier``: shmtier's ``TieringOffloadingSpec(...).get_manager()`` (primary tier in
one POSIX shm segment, fs tier I/O and compression in tier worker processes), waited on
until every worker is up, optionally with another scheduling or compression (the
``shmtier@TOKENS`` variants). ``make_vllm``: the installed vLLM's own (0.33 or 0.34,
shmtier/bench/baseline.py) ``TieringOffloadingManager`` over its
``CPUPrimaryTierOffloadingManager`` and ``FileSystemTierManager``, built from the real
classes as its ``TieringOffloadingSpec.get_manager`` builds them (the same on both
lines). Each comes back as a :class:`Mut`: the manager and what the driver
needs around it (its row view, its contract types, where its files and processes are).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

TOKENS_PER_CHUNK = 16
MODEL = "bench/tiering-steps"


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


def sweep_shm(engine_id: str) -> list[str]:
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
    "batch": "SCHED_BATCH, niceness kept (the workers' default policy)",
    "other": "SCHED_OTHER, niceness kept (the workers' policy before tier_worker_policy)",
    "idle": "SCHED_IDLE",
}


#: cascade admission rules a variant may name (shmtier/scheduler/tiering/admission.py)
ADMISSION_TOKENS = ("second_touch",)
#: compression modes a variant may name (``compression``)
COMPRESSION_TOKENS = {"raw": "none", "zstd": "zstd", "zauto": "auto"}
#: the fs tier's ``direct_io`` a variant may name: O_DIRECT stores, both ways, or buffered
DIRECT_IO_TOKENS = {"dio": "writes", "dioauto": "auto", "buffered": False,
                    "dioadapt": "adaptive"}
#: every token of ``shmtier@TOKENS``
VARIANT_TOKENS = (*WORKER_SCHED, *COMPRESSION_TOKENS, *DIRECT_IO_TOKENS, "noprobe", "nowindow",
                  "wincpu", "winany", *ADMISSION_TOKENS)


def page_cache_bound(token: str) -> int | str | None:
    """The fs tier's ``page_cache_bytes`` a variant token sets: ``pcN`` N MiB (in bytes),
    ``pcauto`` "auto", ``pcoff`` None (no limit); else ``...`` (Ellipsis: not such a token)."""
    if token == "pcauto":
        return "auto"
    if token == "pcoff":
        return None
    if token.startswith("pc") and token[2:].isdigit() and int(token[2:]) > 0:
        return int(token[2:]) << 20
    return ...


def promotion_lane(token: str) -> int | None:
    """The ``tier_promotion_workers`` a variant token sets (``laneN``: N), else None."""
    if token.startswith("lane") and token[4:].isdigit():
        return int(token[4:])
    return None


def known_manager(name: str) -> bool:
    """Whether ``name`` is ``vllm``, ``shmtier`` or ``shmtier@TOKENS`` ('+'-joined
    ``VARIANT_TOKENS``, ``pcN``, ``pcauto``, ``pcoff`` or ``laneN``): what the benches'
    ``--managers`` accept."""
    base, at, variant = name.partition("@")
    if not at:
        return base in MAKERS
    return base == "shmtier" and all(t in VARIANT_TOKENS or page_cache_bound(t) is not ...
                                     or promotion_lane(t) is not None
                                     for t in variant.split("+"))


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
    elif how == "other":
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    elif how == "idle":
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))


def sched_of(pid: int) -> str:
    try:
        policy = {os.SCHED_OTHER: "OTHER", os.SCHED_BATCH: "BATCH",
                  os.SCHED_IDLE: "IDLE"}.get(os.sched_getscheduler(pid), "?")
        return f"{policy}/nice {os.getpriority(os.PRIO_PROCESS, pid)}"
    except OSError:
        return "?"


def make_shmtier(cfg, root: str, engine_id: str, variant: str = "",
                 secondary_tiers: list | None = None) -> Mut:
    """``secondary_tiers``: the engine's ``secondary_tiers`` as given (``[]``: the CPU tier
    alone, no tier workers); None: one fs tier on ``root`` as the options below make it.
    ``variant``: '+'-joined tokens, each a WORKER_SCHED key, a compression mode
    (``raw`` = "none", ``zstd``, ``zauto`` = "auto"), the fs tier's ``direct_io`` (``dio``:
    "writes", O_DIRECT stores; ``dioauto``: "auto", both ways; ``buffered``: false;
    ``dioadapt``: "adaptive", the default), ``noprobe`` (the fs tier's ``probe_unknown`` off: a key
    its index does not know is a MISS at once, as before shared roots), ``nowindow`` (no
    step-window poll thread: ``tier_poll_window`` 0, every poll inside the steps), ``wincpu`` /
    ``winany`` (``tier_poll_window_cpu`` "engine" / "any"), a
    cascade admission rule (``second_touch``; default: write-through), ``pcN`` / ``pcauto`` /
    ``pcoff`` (the fs tier's ``page_cache_bytes`` = N MiB, "auto", null) or ``laneN``
    (``tier_promotion_workers`` N: 0 is every worker background, as before issue 29),
    e.g. ``raw+nice0``."""
    tokens = [t for t in variant.split("+") if t]
    sched = next((t for t in tokens if t in WORKER_SCHED), cfg.worker_sched)
    compression = COMPRESSION_TOKENS.get(
        next((t for t in tokens if t in COMPRESSION_TOKENS), ""), cfg.compression)
    direct_io = DIRECT_IO_TOKENS.get(next((t for t in tokens if t in DIRECT_IO_TOKENS), ""),
                                     cfg.direct_io)
    from shmtier import contract
    from shmtier.config import KVLayout
    from shmtier.spec import TieringOffloadingSpec

    layout = KVLayout(MODEL, "bfloat16", TOKENS_PER_CHUNK, cfg.chunk_bytes, 1)
    extra = {"cpu_bytes_to_use": cfg.cpu_bytes,
             "secondary_tiers": [{"type": "fs", "root_dir": root, "min_free_bytes": None,
                                  "probe_unknown": "noprobe" not in tokens}],
             "num_tier_workers": cfg.workers}
    if compression is not None:  # else shmtier's default
        extra["compression"] = compression
    if secondary_tiers is not None:
        extra["secondary_tiers"] = list(secondary_tiers)
    else:
        if direct_io is not None:
            extra["secondary_tiers"][0]["direct_io"] = direct_io
        if cfg.write_depth is not None:
            extra["secondary_tiers"][0]["write_depth"] = cfg.write_depth
    if "nowindow" in tokens:
        extra["tier_poll_window"] = 0
    if "wincpu" in tokens or "winany" in tokens:  # the step-window thread's CPU
        extra["tier_poll_window_cpu"] = "engine" if "wincpu" in tokens else "any"
    bound = next((b for b in map(page_cache_bound, tokens) if b is not ...), ...)
    if bound is not ... and secondary_tiers is None:
        extra["secondary_tiers"][0]["page_cache_bytes"] = bound
    lane = next((k for k in map(promotion_lane, tokens) if k is not None), None)
    if lane is not None:
        extra["tier_promotion_workers"] = lane
    admission = next((t for t in tokens if t in ADMISSION_TOKENS), None)
    if admission is not None:
        extra["admission"] = admission
    spec = TieringOffloadingSpec(extra, layout, engine_id)
    manager = spec.get_manager()
    try:
        rows = np.asarray(manager.primary.get_kv_memoryview()).view(np.uint8)
        pool = spec.worker_pool  # None: no tier needs workers
        pids = [p.pid for p in pool._procs if p is not None] if pool is not None else []
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
        mut.worker_sched = sorted({sched_of(pid) for pid in pids})
        return mut
    except BaseException:
        manager.shutdown()
        raise


def _vllm_spec_standin(cfg):
    """The attributes vLLM's FileSystemTierManager (0.33, 0.34) reads from its offloading_spec:
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
        rows = np.asarray(primary.get_kv_memoryview()).view(np.uint8)  # vLLM: int8
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
