"""What every tier backend gives the tier-worker job loop: the interface and its result type.

Runs in: tier worker processes only (the job loop calls a backend for one job at a
time, on the worker's one thread). Nothing here imports torch or vLLM.

A backend is the worker half of a secondary tier (DESIGN §5): it moves chunks between
arena rows and one medium (files, objects, peers), for one job descriptor at a time.
The scheduler half (presence index, capacity accounting, eviction, lookups) never calls a
backend directly; it sends job descriptors and reads results. Backend calls may block on
I/O for as long as the medium takes; that is why they run in worker processes.

Per-key outcomes are short strings ``"<kind>"`` or ``"<kind>:<detail>"``:

=========== ======================================================================== =====
kind        meaning                                                                  ops
=========== ======================================================================== =====
``ok``      done: stored / loaded (row holds verified bytes) / deleted / present     all
``exists``  store only: the chunk was already there; nothing written (a success)     store
``missing`` no such chunk (load: a MISS; delete: nothing to do; probe: absent)       l/d/p
``full``    store refused for capacity, nothing left behind: ``full:max_bytes``,      store
            ``full:min_free`` or ``full:<ERRNO> <text>`` (ENOSPC, EDQUOT from the
            medium). The scheduler half should evict (send deletes) and may retry.
``corrupt`` load only: the stored chunk failed verification, ``corrupt:<reason>``    load
            with reason in {magic, version, length, key, checksum, codec}; the bad
            copy was removed (if the medium allowed) and counted. Treat as a MISS.
``error``   the medium failed for this key: ``error:<ERRNO> <strerror> (<step>)``,   all
            e.g. ``error:EROFS Read-only file system (create)``. Nothing published.
``invalid`` the request for this key is malformed (``invalid:<what>``): empty or     all
            over-long key, row out of range. A bug in the sender, not the medium.
=========== ======================================================================== =====

After a ``load`` outcome other than ``ok`` the content of that key's row is undefined
(a backend may have decoded into it before the check failed): the scheduler must not
serve it, it frees the reserved row and reports a MISS.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

OK = "ok"
EXISTS = "exists"
MISSING = "missing"
FULL = "full"
CORRUPT = "corrupt"
ERROR = "error"
INVALID = "invalid"

OUTCOME_KINDS = (OK, EXISTS, MISSING, FULL, CORRUPT, ERROR, INVALID)

#: Which outcome kinds count as success, per op.
SUCCESS_KINDS = {
    "store": frozenset((OK, EXISTS)),
    "load": frozenset((OK,)),
    "delete": frozenset((OK, MISSING)),
    "probe": frozenset((OK,)),
}


def outcome_kind(outcome: str) -> str:
    """The kind of an outcome string (the part before the first ``:``)."""
    return outcome.split(":", 1)[0]


@dataclass
class BatchResult:
    """Result of one backend call over a batch of keys, index-aligned with the keys.

    ``logical_bytes[i]``: raw chunk bytes moved for key i (0 unless it succeeded; for
    ``probe`` and ``delete`` 0). ``stored_bytes[i]``: bytes the chunk occupies on the
    medium (store: what was written, or the size found for ``exists``; load/probe: the
    stored size; delete: the bytes freed; 0 when unknown). ``io_seconds`` and
    ``codec_seconds`` are the batch's totals (wall time in medium calls and in the codec).
    """

    op: str
    outcomes: list[str]
    logical_bytes: list[int]
    stored_bytes: list[int]
    io_seconds: float = 0.0
    codec_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, op: str, n: int) -> "BatchResult":
        return cls(op, [""] * n, [0] * n, [0] * n)

    def ok(self, i: int) -> bool:
        """True if key i succeeded for this op (see ``SUCCESS_KINDS``)."""
        return outcome_kind(self.outcomes[i]) in SUCCESS_KINDS[self.op]

    @property
    def succeeded(self) -> list[bool]:
        good = SUCCESS_KINDS[self.op]
        return [outcome_kind(o) in good for o in self.outcomes]

    @property
    def all_ok(self) -> bool:
        return all(self.succeeded)

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if outcome_kind(o) == kind)

    @property
    def total_logical(self) -> int:
        return sum(self.logical_bytes)

    @property
    def total_stored(self) -> int:
        return sum(self.stored_bytes)

    def to_msg(self) -> dict:
        """A msgpack-ready map (plain lists, str, int, float) for the result ring."""
        return {
            "op": self.op,
            "outcomes": list(self.outcomes),
            "logical_bytes": list(self.logical_bytes),
            "stored_bytes": list(self.stored_bytes),
            "io_s": self.io_seconds,
            "codec_s": self.codec_seconds,
        }


@dataclass(frozen=True)
class WorkerContext:
    """What every backend of one engine's tier workers shares: the layout fingerprint
    (chunks of other layouts are never mixed in), the KV bytes of a chunk, the bytes
    per KV element (the codec splits 2-byte elements) and the codec settings."""

    namespace: str
    chunk_bytes: int
    element_size: int
    codec: Any = None  # a shmtier.shared.codec.CompressionConfig (None: its defaults)


class ScanEntry(NamedTuple):
    """One chunk found on the medium by ``scan``: its key, stored size, mtime (epoch s)."""

    key: bytes
    stored_bytes: int
    mtime: float


class TierBackend(abc.ABC):
    """The worker half of a secondary tier.

    Called by: the tier worker's job loop, one call per job, from one thread of a tier
    worker process (a backend object is not thread-safe: it reuses buffers). Every
    method may block on the medium. No method raises for a problem with one key or one
    stored chunk: those become per-key outcomes. They raise only for a malformed call
    (wrong arena shape, keys/rows of different lengths), which the job loop reports as a
    failed job.

    Arena arguments are the segment's arena as a writable 2-D uint8 array
    ``(num_chunks, row_stride)`` (a numpy view of the shared memory; a 2-D memoryview is
    accepted too); row ``r`` is chunk slot ``r`` and only its first ``chunk_bytes`` are
    payload. Backends never touch bytes of a row past ``chunk_bytes``.
    """

    @abc.abstractmethod
    def store(self, keys: Sequence[bytes], rows: Sequence[int], arena, chunk_bytes: int,
              **kwargs) -> BatchResult:
        """Persist row ``rows[i]`` (first ``chunk_bytes``) under ``keys[i]``; rows are read only.

        The job loop passes ``hurry=True`` when the worker is behind on stores: a
        backend with an adaptive codec should then take its cheapest path."""

    @abc.abstractmethod
    def load(self, keys: Sequence[bytes], rows: Sequence[int], arena,
             chunk_bytes: int) -> BatchResult:
        """Fill row ``rows[i]`` with the verified chunk of ``keys[i]``; see the row rule above."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[bytes]) -> BatchResult:
        """Remove the chunks of ``keys`` (``missing`` when there was none)."""

    @abc.abstractmethod
    def probe(self, keys: Sequence[bytes]) -> BatchResult:
        """Presence check without reading data: ``ok`` (present, with stored size) or ``missing``."""

    @abc.abstractmethod
    def scan(self) -> Iterator[ScanEntry]:
        """Every chunk on the medium, for rebuilding the scheduler's index (warm restart)."""

    @classmethod
    @abc.abstractmethod
    def open(cls, args: dict, context: WorkerContext) -> "TierBackend":
        """Build the backend in a tier worker from its tier's ``worker_args`` (checked in
        the scheduler when the spec was built) and the engine's ``context``; may block
        briefly on the medium; raises when the medium cannot be used."""

    def close(self) -> None:
        """Release the backend's resources (buffers, descriptors). Idempotent."""


def as_arena(arena) -> np.ndarray:
    """``arena`` as a writable 2-D uint8 ndarray whose rows are contiguous (no copy)."""
    a = np.asarray(arena)
    if a.dtype != np.uint8 or a.ndim != 2:
        raise ValueError(f"arena must be a 2-D uint8 array, got dtype={a.dtype} ndim={a.ndim}")
    if a.shape[1] and a.strides[1] != 1:
        raise ValueError(f"arena rows must be contiguous, got strides={a.strides}")
    return a


def check_batch(keys: Sequence[bytes], rows: Sequence[int], arena: np.ndarray,
                chunk_bytes: int) -> None:
    """Raise ValueError for a malformed batch (a sender bug, failing the whole job)."""
    if len(keys) != len(rows):
        raise ValueError(f"keys and rows differ in length: {len(keys)} keys, {len(rows)} rows")
    if not 0 < chunk_bytes <= arena.shape[1]:
        raise ValueError(
            f"chunk_bytes={chunk_bytes} must be in 1..row_stride ({arena.shape[1]})"
        )
