"""What every tier worker needs to know, published by the scheduler in the segment.

The scheduler writes one msgpack blob at the end of the segment's ring area
before any worker starts; spawned workers and an external pool (``shmtier
workers --engine-id``) read the same blob, so both modes start from one source
of truth. Layout: ``u32 length`` + msgpack map, in the last ``CONFIG_BYTES``
of the ring area. Imports neither torch nor vLLM.

``rings_len_for(config)`` is the ring area a segment needs for a config: the
scheduler (creating the segment) and GPU worker processes (joining it) pass
the same value to ``open_segment``.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from shmtier.shared.ring import ring_area_nbytes

CONFIG_BYTES = 64 << 10
# Exit code of a tier worker whose tier backends could not be built (e.g. an fs tier's
# root_dir is missing): the pool counts it as a failure to start.
EXIT_BACKENDS_FAILED = 4
#: Default ``worker_niceness`` (the ``tier_worker_niceness`` key): added to the niceness a
#: tier worker inherits: a smaller CPU share than the scheduler thread (that a woken worker
#: does not preempt it at all is ``worker_policy``'s job).
DEFAULT_WORKER_NICENESS = 10
#: Scheduling policies a tier worker may run under (the ``tier_worker_policy`` key):
#: ``"batch"`` (SCHED_BATCH, the default: a woken worker never preempts a running
#: thread, it waits for the tick or an idle core; bench/README.md, "Slowest steps") or
#: ``"other"`` (SCHED_OTHER, the kernel's default for every process).
WORKER_POLICIES = ("batch", "other")
DEFAULT_WORKER_POLICY = "batch"
_LEN = struct.Struct("<I")


@dataclass
class PoolConfig:
    """``tiers[i]`` is None for a tier that has no worker half, else
    ``{"type": "fs", "args": {...}}``: its registered tier type (whose backend the
    workers build, ``shmtier/tiers/registry.py``) and the options its backend takes
    (``TierConfig.worker_args``). ``codec``: the ``compression`` setting as a map.
    ``slots`` and ``slot_size`` size each worker's two rings (a job of about 200
    keys fits one slot).

    ``mode`` is how the engine's pool runs its workers (``"spawn"``: the scheduler
    starts them; ``"external"``: ``shmtier workers`` does); the pool writes it, and
    ``shmtier workers`` refuses a spawn-mode engine. ``job_timeout_s`` is the
    deadline of one pool job part: a worker that holds a part longer is killed and
    its parts fail (their CPU rows are released). ``worker_niceness`` (0..19, the
    ``tier_worker_niceness`` key) is added to the niceness each worker inherits, by the
    worker itself before it starts any thread (``workers/job_loop.py``), spawned or
    external alike; ``worker_policy`` (``WORKER_POLICIES``, the ``tier_worker_policy``
    key) is the scheduling policy it then sets for itself, inherited by its threads.
    ``promotion_workers`` (the ``tier_promotion_workers`` key, 0..``num_workers`` - 1):
    the last that many workers form the promotion lane (``shared/lanes.py``): they skip
    both settings (they run at the priority they inherit, under SCHED_OTHER) and take
    loads and probes; the others take stores and deletes."""

    num_workers: int
    chunk_bytes: int
    slots: int = 128
    slot_size: int = 8 << 10
    element_size: int = 2
    heartbeat_interval_s: float = 0.25
    codec: dict[str, Any] = field(default_factory=dict)
    tiers: list[Any] = field(default_factory=list)
    mode: str = "spawn"
    job_timeout_s: float = 60.0
    worker_niceness: int = DEFAULT_WORKER_NICENESS
    worker_policy: str = DEFAULT_WORKER_POLICY
    promotion_workers: int = 0

    def __post_init__(self) -> None:
        k = self.promotion_workers
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < max(1, self.num_workers):
            raise ValueError(f"tier worker pool config: promotion_workers = {k!r} is invalid: "
                             f"expected an integer in 0..{max(0, self.num_workers - 1)} (at "
                             f"least one of its {self.num_workers} workers stays background)")

    def write(self, rings_area: memoryview) -> None:
        blob = msgpack.packb(asdict(self), use_bin_type=True)
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
        return cls(**msgpack.unpackb(bytes(rings_area[start + _LEN.size : start + _LEN.size + length]),
                                     raw=False))


def rings_len_for(config: PoolConfig) -> int:
    """Ring area size a segment needs for ``config`` (rings + the config blob)."""
    return ring_area_nbytes(config.num_workers, config.slots, config.slot_size) + CONFIG_BYTES
