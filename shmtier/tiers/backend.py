"""What every tier backend gives the tier-worker job loop: the interface and its result type.

Runs in: tier worker processes only (the job loop calls a backend for one job at a
time, on the worker's one thread). Nothing here imports torch or vLLM.

A backend is the worker half of a secondary tier (docs/design.md §5): it moves chunks between
arena rows and one medium (files, objects, peers), for one job descriptor at a time.
The scheduler half (presence index, capacity accounting, eviction, lookups) never calls a
backend directly; it sends job descriptors and reads results. Backend calls may block on
I/O for as long as the medium takes; that is why they run in worker processes.

Per-key outcomes are :class:`shmtier.shared.jobs.Outcome` members (its docstring says
what each means for which op), with a detail text per key (``BatchResult.details``:
e.g. ``"max_bytes"`` for a REJECTED store, ``"checksum"`` for a CORRUPT load,
``"EROFS Read-only file system (create)"`` for an ERROR; empty when there is nothing
to add). :data:`shmtier.shared.jobs.SUCCESS` says which outcomes are a success per op.

Which op runs which method: :attr:`TierBackend.HANDLERS` (op -> method name), read
through :meth:`TierBackend.handler`. A backend that does not handle an op leaves it out
of its table; the job loop then answers that op's jobs with an error result.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Iterator, NamedTuple, Sequence

import numpy as np

from shmtier.shared import jobs
from shmtier.shared.jobs import SUCCESS, Outcome
from shmtier.shared.ring import TIER_COUNTERS

__all__ = ["BatchResult", "Outcome", "ScanEntry", "TierBackend", "UnsupportedOp",
           "WorkerContext", "as_arena", "check_batch", "row_problem"]


_ANSWERS = frozenset((Outcome.OK, Outcome.EXISTS, Outcome.MISS))


@dataclass
class BatchResult:
    """Result of one backend call over a batch of keys; every list is index-aligned
    with the keys. The per-key fields and ``codec_s`` are those of the wire record
    (``jobs.Result``), the lists handed on uncopied; :meth:`to_result` is the one
    conversion, because the wire carries no text per key: ``details`` (worker-side only)
    become the result's one ``error`` text.

    ``outcomes[i]`` and ``details[i]``: what happened to key i and, in words, why
    (empty when nothing to add). ``logical_bytes[i]``: raw chunk bytes moved for key i
    (0 unless it succeeded; for ``probe`` and ``delete`` 0). ``stored_bytes[i]``: bytes
    the chunk occupies on the medium (store: what was written, or the size found for
    EXISTS; load/probe: the stored size; delete: the bytes freed; 0 when unknown).
    ``seconds[i]``: wall time spent on key i, in medium calls and in the codec (a cost
    the batch shares, e.g. one free-space query or a directory fsync, is charged to
    the keys that share it). ``codec_s``: of all that, the time in the codec.
    """

    op: str
    outcomes: list[Outcome]
    details: list[str]
    logical_bytes: list[int]
    stored_bytes: list[int]
    seconds: list[float]
    codec_s: float = 0.0

    @classmethod
    def empty(cls, op: str, n: int) -> "BatchResult":
        """``n`` keys, each ERROR until the backend says otherwise."""
        return cls(op, [Outcome.ERROR] * n, [""] * n, [0] * n, [0] * n, [0.0] * n)

    def set(self, i: int, outcome: Outcome, detail: str = "") -> None:
        """Key i's outcome and its detail text."""
        self.outcomes[i] = outcome
        self.details[i] = detail

    def ok(self, i: int) -> bool:
        """True if key i succeeded for this op (see ``jobs.SUCCESS``)."""
        return self.outcomes[i] in SUCCESS[self.op]

    @property
    def succeeded(self) -> list[bool]:
        good = SUCCESS[self.op]
        return [o in good for o in self.outcomes]

    @property
    def all_ok(self) -> bool:
        return all(self.succeeded)

    def count(self, outcome: Outcome) -> int:
        return self.outcomes.count(outcome)

    @property
    def total_logical(self) -> int:
        return sum(self.logical_bytes)

    @property
    def total_stored(self) -> int:
        return sum(self.stored_bytes)

    @property
    def io_seconds(self) -> float:
        """Wall time in medium calls: the keys' seconds less the codec's."""
        return max(0.0, sum(self.seconds) - self.codec_s)

    def extend(self, other: "BatchResult") -> None:
        """Append the keys of ``other`` (a later slice of the same job)."""
        self.outcomes += other.outcomes
        self.details += other.details
        self.logical_bytes += other.logical_bytes
        self.stored_bytes += other.stored_bytes
        self.seconds += other.seconds
        self.codec_s += other.codec_s

    def summary(self, limit: int = 500) -> str:
        """What went wrong, in words, for a result's error text: one entry per distinct
        (outcome, detail) of ERROR, CORRUPT, REJECTED and INVALID keys, with its number
        of keys; "" when there were none (OK, EXISTS and MISS are answers, not faults).
        ``jobs.failure_reason`` reads it back without the numbers."""
        counts: dict[tuple[Outcome, str], int] = {}
        for outcome, detail in zip(self.outcomes, self.details):
            if outcome not in _ANSWERS:
                counts[(outcome, detail)] = counts.get((outcome, detail), 0) + 1
        text = "; ".join(f"{n} {o.name}" + (f" ({d})" if d else "")
                         for (o, d), n in sorted(counts.items()))
        return text if len(text) <= limit else text[:limit - 3] + "..."

    def to_result(self, job_id: jobs.WireJobId, error: str = "") -> jobs.Result:
        """The wire result of this batch for job ``job_id`` (``error`` or else
        :meth:`summary` as its error text; times clamped to >= 0)."""
        return jobs.Result(job_id, self.outcomes, self.logical_bytes, self.stored_bytes,
                           [t if t > 0.0 else 0.0 for t in self.seconds],
                           max(0.0, self.codec_s), error or self.summary())


@dataclass(frozen=True)
class WorkerContext:
    """What every backend of one engine's tier workers shares: the layout fingerprint
    (chunks of other layouts are never mixed in), the KV bytes of a chunk, the bytes
    per KV element (the codec splits 2-byte elements) and the codec settings."""

    namespace: str
    chunk_bytes: int
    element_size: int
    codec: Any = None  # a shmtier.shared.codec.CompressionConfig (None: its defaults)
    # This worker replaces one that served its slot before (it died, hung or was
    # restarted): what it finds changed on the medium at open may have changed under the
    # scheduler's index. A first worker at engine start finds the medium as the
    # scheduler's first listing will.
    replacement: bool = False
    # The engine these workers serve (its id as the pool started them with): a tier that
    # counts per engine on a medium engines share (node) counts under it.
    engine_id: str = ""


class UnsupportedOp(LookupError):
    """A job asked a backend for an op its ``HANDLERS`` table does not list."""


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

    ``HANDLERS`` maps each op this backend handles to the name of its method (checked
    when the class is defined: ops of ``jobs.OPS`` but ``stop``, callable methods). A
    subclass that does not handle an op gives a table without it.
    """

    HANDLERS: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"store": "store", "load": "load", "delete": "delete", "probe": "probe",
         "scan": "scan"})
    #: Store keys the backend writes in parallel within one ``store`` call: the job loop
    #: hands over at least this many at once (the fs tier's O_DIRECT ``write_depth``).
    writes_in_flight: int = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for op, name in cls.HANDLERS.items():
            if op not in jobs.OPS or op == "stop":
                raise TypeError(f"{cls.__name__}.HANDLERS: {op!r} is not a backend op "
                                f"(ops: {', '.join(o for o in jobs.OPS if o != 'stop')})")
            if not callable(getattr(cls, name, None)):
                raise TypeError(f"{cls.__name__}.HANDLERS: op {op!r} names {name!r}, which "
                                f"is not a method of the class")

    def handler(self, op: str) -> Callable[..., Any]:
        """The bound method that runs ``op``; :class:`UnsupportedOp` if this backend
        does not handle it."""
        name = type(self).HANDLERS.get(op)
        if name is None:
            raise UnsupportedOp(f"the {type(self).__name__} backend does not handle op "
                                f"{op!r} (it handles: {', '.join(type(self).HANDLERS)})")
        return getattr(self, name)

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
        """Remove the chunks of ``keys`` (MISS when there was none)."""

    @abc.abstractmethod
    def probe(self, keys: Sequence[bytes]) -> BatchResult:
        """Presence check without reading data: OK (present, with stored size) or MISS."""

    @abc.abstractmethod
    def scan(self) -> Iterator[ScanEntry]:
        """Every chunk on the medium, for rebuilding the scheduler's index (warm restart)."""

    @classmethod
    @abc.abstractmethod
    def open(cls, config: Any, context: WorkerContext) -> "TierBackend":
        """Build the backend in a tier worker from its tier's frozen ``config`` (the tier
        type's ``TierConfig``, checked in the scheduler when the spec was built and read
        back from the segment's pool config) and the engine's ``context``; may block
        briefly on the medium; raises when the medium cannot be used."""

    def take_flags(self) -> int:
        """The ``jobs.ResultFlag`` bits this backend raised since the last call (0: none),
        cleared. The job loop calls it after every job it ran on the backend and sends
        them with that job's result (e.g. ``NAMESPACE_RESET``, noticed during any op)."""
        return 0

    def worker_counts(self) -> tuple[int, ...]:
        """What this backend counted, since it was made, of ``ring.TIER_COUNTERS`` (in
        that order; 0 for a name it does not count): events no result shows, which the
        job loop adds to the worker slot's counters after every job (the tier's scheduler
        half exports them as metrics; ``shmtier top`` shows them). This default reads the
        same-named int fields of the backend's ``counters`` object (the fs and obj tiers'
        ``FsCounters``/``ObjCounters``); a backend that keeps them elsewhere overrides it.
        Never blocks."""
        c = getattr(self, "counters", None)
        return tuple(int(getattr(c, name, 0) or 0) for name in TIER_COUNTERS)

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


def row_problem(row, num_rows: int) -> str | None:
    """What makes ``row`` INVALID for an arena of ``num_rows`` rows (the detail), or None."""
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
        return f"row {row!r} is not an integer"
    if not 0 <= row < num_rows:
        return f"row {row} out of range 0..{num_rows - 1}"
    return None
