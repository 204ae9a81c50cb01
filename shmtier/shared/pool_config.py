"""What every tier worker needs to know, published by the scheduler in the segment.

The scheduler writes one msgpack blob at the end of the segment's ring area
before any worker starts; spawned workers and an external pool (``shmtier
workers --engine-id``) read the same blob, so both modes start from one source
of truth. Layout: ``u32 length`` + msgpack map (``PoolConfig.to_dict``: the frozen
configs as plain data, each tier's config whole), in the last ``CONFIG_BYTES``
of the ring area; read back (``from_dict``) into the same frozen, typed configs, whose
values are not checked again (the scheduler checked them). Imports neither torch nor
vLLM (a tier's config class is imported from the registry when the blob is read).

``rings_len_for(config)`` is the ring area a segment needs for a config: the
scheduler (creating the segment) and GPU worker processes (joining it) pass
the same value to ``open_segment``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from shmtier.options import REQUIRED, Check, Options, integer, number, one_of, option
from shmtier.shared.codec import CompressionConfig
from shmtier.shared.lanes import default_promotion_workers
from shmtier.shared.ring import ring_area_nbytes

CONFIG_BYTES = 64 << 10
# Exit code of a tier worker whose tier backends could not be built (e.g. an fs tier's
# root_dir is missing): the pool counts it as a failure to start.
EXIT_BACKENDS_FAILED = 4
#: How the engine's tier workers run (the ``workers`` key).
WORKER_MODES = ("spawn", "external")
#: Scheduling policies a tier worker may run under (the ``tier_worker_policy`` key).
WORKER_POLICIES = ("batch", "other")
_LEN = struct.Struct("<I")


@dataclass(frozen=True, kw_only=True)
class WorkerPoolOptions(Options):
    """The user's keys of the tier worker pool (of ``kv_connector_extra_config``, checked
    where the spec is built), carried to the workers inside :class:`PoolConfig`."""

    num_tier_workers: int = option(
        2, integer(1),
        doc="tier worker processes doing all tier I/O and compression (when a worker-backed "
            "tier such as fs or obj is configured); at most 4 per core and one per 128 MiB of "
            "available memory (the error names this host's figures)")
    workers: str = option(
        "spawn", one_of(*WORKER_MODES),
        doc='"spawn": the scheduler starts the tier workers; "external": `shmtier workers '
            '--engine-id ID` runs them next to the engine')
    tier_job_timeout_s: float = option(
        60.0, number(0, min_open=True).then(float),
        doc="deadline of one tier worker job: a worker still holding a job this long after "
            "it was submitted is killed and its jobs fail (their CPU rows are released)")
    tier_worker_niceness: int = option(
        10, integer(0, 19),
        doc="added to the niceness each background tier worker inherits (spawned or "
            "external; not the promotion lane's, tier_promotion_workers), by the worker before "
            "it starts any thread: higher keeps the workers from preempting the scheduler "
            "thread, lower lets cascades keep up")
    tier_worker_policy: str = option(
        "batch", one_of(*WORKER_POLICIES),
        doc='the background tier workers\' scheduling policy: "batch" (SCHED_BATCH: a '
            "worker woken by a job never preempts a running thread, so the scheduler thread "
            'that posted it keeps its core) or "other" (SCHED_OTHER, every process\'s default)')
    tier_promotion_workers: int | None = option(
        None, integer(0),
        doc="of the tier workers, the last this many (fewer than num_tier_workers) form the "
            "promotion lane: they run at the engine's priority (the niceness they inherit, "
            "SCHED_OTHER; external: `shmtier workers`' own) and take promotions' loads and "
            "lookup probes, which a waiting request needs; the others stay background "
            "(tier_worker_niceness, tier_worker_policy) and take cascades and deletes; a lane "
            "with no running worker lends the other's (docs/architecture.md, \"Tier worker "
            "lanes\")",
        default_doc="1 with two or more tier workers, else 0")

    @property
    def promotion_workers(self) -> int:
        """How many workers form the promotion lane (``shared/lanes.py``):
        ``tier_promotion_workers``, or its default for ``num_tier_workers`` when unset."""
        if self.tier_promotion_workers is None:
            return default_promotion_workers(self.num_tier_workers)
        return self.tier_promotion_workers


@dataclass(frozen=True)
class PoolTier:
    """A secondary tier as its tier workers see it: its registered tier type (whose
    backend they build, ``shmtier/tiers/registry.py``) and its frozen config."""

    type: str
    options: Any  # the tier type's TierConfig

    def to_plain(self) -> dict[str, Any]:
        return {"type": self.type, "options": self.options.to_dict()}

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> "PoolTier":
        from shmtier.tiers import registry

        tier = registry.registered(plain["type"])
        if tier is None:
            raise ValueError(f"tier type {plain['type']!r} is not registered in this process")
        return cls(plain["type"], tier.config_class().from_dict(plain["options"]))


def _tiers() -> Check:
    return Check("a tuple of PoolTier (None for a tier without tier workers)", tuple,
                 to_plain=lambda tiers: [t.to_plain() if t is not None else None
                                         for t in tiers],
                 from_plain=lambda plain: tuple(PoolTier.from_plain(t) if t is not None
                                                else None for t in plain))


@dataclass(frozen=True, kw_only=True)
class PoolConfig(Options):
    """``tiers[i]`` is None for a tier that has no worker half, else its
    :class:`PoolTier`. ``codec``: the ``compression`` setting. ``slots`` and
    ``slot_size`` size each worker's two rings (a job of about 200 keys fits one slot).
    ``options``: the user's pool keys; its ``workers`` is how the engine's pool runs its
    workers (the pool writes it, and ``shmtier workers`` refuses a spawn-mode engine),
    its ``tier_job_timeout_s`` the deadline of one pool job part (a worker that holds a
    part longer is killed and its parts fail: their CPU rows are released), its
    ``tier_worker_niceness`` and ``tier_worker_policy`` what each background worker sets
    for itself before it starts any thread (``workers/job_loop.py``), spawned or external
    alike; its ``promotion_workers``: the last that many workers form the promotion lane
    (``shared/lanes.py``): they skip both settings (they run at the priority they inherit,
    under SCHED_OTHER) and take loads and probes; the others take stores and deletes."""

    chunk_bytes: int = option(REQUIRED, integer(1), doc="KV bytes of one chunk")
    slots: int = option(128, integer(1), doc="slots of each worker's job and result rings")
    slot_size: int = option(8 << 10, integer(64), doc="bytes of one ring slot")
    element_size: int = option(2, integer(1, 255), doc="bytes per KV element")
    heartbeat_interval_s: float = option(0.25, number(0, min_open=True),
                                         doc="how often a worker beats")
    codec: CompressionConfig = option(CompressionConfig(), CompressionConfig.check(),
                                      doc="the compression setting")
    tiers: tuple[PoolTier | None, ...] = option((), _tiers(), doc="the secondary tiers")
    options: WorkerPoolOptions = option(WorkerPoolOptions(), WorkerPoolOptions.as_check(),
                                        doc="the user's pool keys")

    def write(self, rings_area: memoryview) -> None:
        blob = msgpack.packb(self.to_dict(), use_bin_type=True)
        if len(blob) + _LEN.size > CONFIG_BYTES:
            raise ValueError(f"tier worker config is {len(blob)} bytes; at most "
                             f"{CONFIG_BYTES - _LEN.size} fit in the segment")
        start = len(rings_area) - CONFIG_BYTES
        rings_area[start + _LEN.size : start + _LEN.size + len(blob)] = blob
        _LEN.pack_into(rings_area, start, len(blob))

    @classmethod
    def read(cls, rings_area: memoryview) -> "PoolConfig":
        start = len(rings_area) - CONFIG_BYTES
        (length,) = _LEN.unpack_from(rings_area, start)
        if not 0 < length <= CONFIG_BYTES - _LEN.size:
            raise ValueError("the segment holds no tier worker config (no tiers with workers?)")
        return cls.from_dict(msgpack.unpackb(
            bytes(rings_area[start + _LEN.size : start + _LEN.size + length]), raw=False))


def rings_len_for(config: PoolConfig) -> int:
    """Ring area size a segment needs for ``config`` (rings + the config blob)."""
    return (ring_area_nbytes(config.options.num_tier_workers, config.slots, config.slot_size)
            + CONFIG_BYTES)
