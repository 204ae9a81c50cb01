"""Job descriptors (scheduler -> tier worker) and results (worker -> scheduler).

Who calls: the scheduler encodes jobs (``encode_job`` / ``pack_job``, after
``split_job`` when one might not fit a ring slot) and decodes results; a tier
worker decodes jobs and encodes results (``split_result`` when one might not
fit). All functions are pure, thread-safe and never block. Nothing here imports
torch or vLLM.

The vocabulary every stage shares (backends, the job loop, the wire, the pool,
the scheduler halves):

* :class:`Outcome`, what happened to one key (one code per key on the wire; a
  key's detail text, e.g. ``"max_bytes"`` or ``"EIO Input/output error (read)"``,
  travels separately: in a backend's ``BatchResult.details`` and, summed up, in
  a result's ``error`` text); :data:`SUCCESS` says which outcomes are a success
  for which op. :class:`ResultFlag`, what a result says about the medium as a
  whole rather than about a key (e.g. that a tier's namespace was reset).
* three id spaces, each a ``NewType`` of int: the tiering manager's tier job id
  (``shmtier.scheduler.tiering.base.JobId``, vLLM's ``JobId``), the worker
  pool's job id (``shmtier.scheduler.pool.PoolJobId``: what ``WorkerPool.submit``
  returns; one pool job may carry several tier jobs) and :data:`WireJobId`, the
  id of one part of a pool job as it travels in a ring (a pool job is sent as
  one part per worker, each maybe split further by ``split_job``).

A job's answer travels in three records of this one vocabulary (per key ``outcomes``,
``logical_bytes``, ``stored_bytes``, ``seconds``; then ``codec_s``, ``error``, ``listed``,
``flags``): a backend's ``BatchResult`` -> :class:`Result` (the wire) -> the pool's
``PoolResult``, then vLLM's ``JobResult`` per tier job; each conversion has one reason,
in its record's docstring (docs/architecture.md, "Completion", lists them).

Wire format (msgpack, schema version ``SCHEMA_VERSION``): positional arrays,
not maps — measured here a 4-key job packs in ~0.46 µs as an array vs ~0.74 µs
as a map and unpacks in ~0.34 vs ~0.78 µs, and is 15% smaller::

    job    [version, 0, job_id, op, tier, keys, rows, args]
    result [version, 1, job_id, outcomes, logical, stored, seconds, codec_s,
            error, listed, more, flags]

* ``op`` is a small integer (``OPS`` maps names to codes); ``keys`` a list of
  bin (the chunk keys), ``rows`` a list of arena row numbers aligned with
  ``keys`` (``store``/``load``) or empty; ``args`` a map of job-level,
  op-specific values with str keys (known ones are type-checked, see
  ``ARG_TYPES``; others pass through). Per-key data lives only in
  ``keys``/``rows``, so splitting a job copies ``args`` to every part.
* In a result, ``outcomes`` is a bin of one :class:`Outcome` code per key the
  result answers for; ``logical`` (uint32 little-endian), ``seconds`` (float32
  little-endian) are packed bins with one entry per such key: the chunk bytes
  the backend moved for it and the wall time it spent on it (medium and codec);
  ``stored`` (uint32 LE) has one entry per such key (the bytes the chunk
  occupies on the medium), then one per listed key. ``codec_s`` is the
  result's codec seconds (float64), ``error`` a human-readable summary of what
  went wrong (empty when nothing did), ``listed`` the keys a ``scan`` found, and
  ``more`` says further results for the same job id follow (a result too large
  for one ring slot, split by ``split_result``: the keys a result answers for
  are the next run of the part's keys, in order). ``flags`` is an unsigned int of
  :class:`ResultFlag` bits (0 almost always).

``decode_job``/``decode_result`` raise :class:`MalformedJob` (a ValueError)
with a message naming the problem for anything that is not a valid message of
this schema version; ``err.job_id`` holds the job id when it could be read, so
the worker can answer ``Result.failed(err.job_id, str(err))`` and carry on.

Size (~760 lines): the wire schema, its fast paths' Python twins and the thorough
diagnosis that must agree with them (tests/test_jobs.py checks it), and splitting by
slot size, are one schema version; about a third is the diagnosis of malformed messages.
"""

from __future__ import annotations

import collections
import enum
import re
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NewType

import msgpack

from shmtier.shared._wire import decode_result as _decode_result_c
from shmtier.shared._wire import pack_job as _pack_job_c

# 2: per-key logical/stored bytes and seconds in results, seven outcomes; 3: result flags
SCHEMA_VERSION = 3
KIND_JOB, KIND_RESULT = 0, 1

#: The id of one job part on the wire (what a ring carries; see the module docstring).
WireJobId = NewType("WireJobId", int)

OPS = {"store": 1, "load": 2, "delete": 3, "probe": 4, "scan": 5, "stop": 6}
OP_NAMES = {code: name for name, code in OPS.items()}
# ops whose rows are aligned with keys / that carry no keys at all
_ROW_OPS = frozenset(("store", "load"))
_KEYLESS_OPS = frozenset(("scan", "stop"))


class Outcome(enum.IntEnum):
    """What happened to one key of a job. The value is the key's code on the wire.

    ========== ======================================================================= =====
    member     meaning                                                                 ops
    ========== ======================================================================= =====
    OK         done: stored / loaded (the row holds verified bytes) / deleted /        all
               present
    MISS       no such chunk (load: a miss; delete: nothing to do; probe: absent)      l/d/p
    ERROR      the medium failed for this key (detail ``"<ERRNO> <strerror>            all
               (<step>)"``, e.g. ``"EROFS Read-only file system (create)"``; nothing
               published), or the job failed as a whole (no backend for its tier, a
               malformed job, its worker died: the result's ``error`` says why)
    CORRUPT    load: the stored chunk failed verification (detail: the reason, one     load
               of magic, version, length, key, checksum, codec, mac); the bad copy was
               removed (if the medium allowed) and counted. Treat as a MISS.
    REJECTED   store refused for capacity, nothing left behind (detail                 store
               ``"max_bytes"``, ``"min_free"`` (the job loop adds the free bytes:
               ``min_free_detail``) or ``"<ERRNO> <text> (<step>)"`` for ENOSPC/EDQUOT
               from the medium). The scheduler half should evict and may retry.
    EXISTS     store: the chunk was already there; nothing written (a success; its     store
               stored size is reported)
    INVALID    the request for this key is malformed (detail: what), e.g. an empty or  all
               over-long key or a row out of range: a bug in the sender, not the medium
    ========== ======================================================================= =====

    After a ``load`` outcome other than OK the content of that key's row is undefined
    (a backend may have decoded into it before a check failed): the scheduler must not
    serve it, it frees the reserved row and reports a MISS.
    """

    OK = 0
    MISS = 1
    ERROR = 2
    CORRUPT = 3
    REJECTED = 4
    EXISTS = 5
    INVALID = 6


class ResultFlag:
    """What a worker says about its tier's medium as a whole, along with a result (the
    result's ``flags``; the pool ORs the flags of a pool job's parts). The bits are plain
    ints, not an ``enum.IntFlag``: the scheduler tests two of them on every result it
    processes, and ``int & IntFlag`` runs enum's Python code (~0.9 µs a test, warm).

    ``NAMESPACE_RESET``: the worker found the tier's storage namespace removed, replaced
    or made anew (e.g. an fs tier whose namespace directory, or whole root, was deleted;
    a store then recreated it) since it last looked. Chunks stored before may be gone,
    and the medium holds what is there now: the scheduler half should drop its index of
    the tier (before applying this result's outcomes, which are about the namespace as
    it is now) and list the medium again (a ``scan`` job). Raised by each worker that
    sees the change, once per change it sees (so possibly once per worker).
    """

    NAMESPACE_RESET = 1
    #: On a store's result: the worker's compression-by-cost choice for the tier
    #: (codec mode "auto", ``shared/codec_choice.py``) was raw when it answered (the
    #: scheduler half's gauge ``vllm:kv_offload_shmtier_compression_on``).
    COMPRESSION_OFF = 2
    #: On a store's result: the worker keeps the page cache of its stores to the tier
    #: bounded (fs ``page_cache_bytes``: a fixed bound, or an ``"auto"`` bound once found;
    #: the scheduler half's gauge ``vllm:kv_offload_shmtier_page_cache_bounded``).
    PAGE_CACHE_BOUNDED = 4
    #: On a store's result: the worker's stores to the tier are O_DIRECT now (fs
    #: ``direct_io`` true, "auto" or "writes", or "adaptive" once new page cache proved
    #: expensive; the scheduler half's gauge ``vllm:kv_offload_shmtier_direct_stores``).
    DIRECT_STORES = 8


#: Which outcomes count as a success, per op.
SUCCESS: dict[str, frozenset[Outcome]] = {
    "store": frozenset((Outcome.OK, Outcome.EXISTS)),
    "load": frozenset((Outcome.OK,)),
    "delete": frozenset((Outcome.OK, Outcome.MISS)),
    "probe": frozenset((Outcome.OK,)),
}

#: The detail of a store REJECTED by the free-space floor, and how the job loop completes
#: it with the free bytes the worker saw after the slice (``min_free_detail``); a
#: result's error text sums details up, so the scheduler finds that figure there
#: (``free_bytes_in``): the scheduler process itself never asks the filesystem.
MIN_FREE = "min_free"
_FREE_BYTES = re.compile(r"min_free: (\d+) bytes free")


def min_free_detail(free: int) -> str:
    """``"min_free: <free> bytes free"``."""
    return f"{MIN_FREE}: {int(free)} bytes free"


def free_bytes_in(error: str) -> int | None:
    """The least free-byte figure a ``min_free_detail`` in ``error`` reports, else None."""
    found = _FREE_BYTES.findall(error)
    return min(int(f) for f in found) if found else None


# "<n> " before each "; "-separated part of a result's error text (BatchResult.summary)
_LEADING_COUNTS = re.compile(r"(^|; )\d+ ")


def failure_reason(error: str | None) -> str:
    """A result's error text (``BatchResult.summary``'s) without its numbers of keys: what
    went wrong, the same for every result that failed the same way (a scheduler half logs
    a failure once per reason, not once per result)."""
    return _LEADING_COUNTS.sub(r"\1", error or "")


# Known op-specific args and their types (checked on decode when present).
ARG_TYPES: dict[str, type] = {
    "nbytes": int,        # store/load: logical bytes of each row to move (default: whole row)
    "offset": int,        # store/load: byte offset of those bytes within the row
    "codec": str,         # store: "auto" / "zstd" / "none"
    "level": int,         # store: codec level
    "cursor": bytes,      # scan: resume after this position
    "limit": int,         # scan: at most this many keys
    "deadline_ns": int,   # any: CLOCK_MONOTONIC ns after which the job is pointless
    "bytes_in_use": int,  # store: the scheduler's count of the tier's stored bytes
}
_UINT64_MAX = (1 << 64) - 1
_UINT32_MAX = (1 << 32) - 1
#: The largest per-key byte figure a result carries (``logical_bytes``, ``stored_bytes``:
#: uint32 on the wire). A backend names nothing larger: a chunk of that size is no chunk
#: of any layout (``wire_figures`` fails a key whose figure does not fit).
MAX_KEY_FIGURE = _UINT32_MAX
_F32_MAX = 3.4028234663852886e38


class MalformedJob(ValueError):
    """A message that is not a valid job (or result) of this schema version.

    ``job_id`` is the message's job id when it could be read (else None).
    """

    def __init__(self, message: str, job_id: int | None = None):
        super().__init__(message)
        self.job_id = job_id


class MalformedResult(MalformedJob):
    """A result message that is not valid (the worker that sent it is buggy)."""


@dataclass(slots=True)
class Job:
    """One job for a tier worker. ``op`` is one of ``OPS``; ``tier`` the secondary tier index."""

    job_id: WireJobId
    op: str
    tier: int
    keys: list[bytes] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)


_ResultFields = collections.namedtuple("_ResultFields", (
    "job_id", "outcomes", "logical_bytes", "stored_bytes", "seconds", "codec_s", "error",
    "listed", "more", "flags"))


class Result(_ResultFields):
    """What a worker answers for one job part (or one piece of it, see ``more``).

    ``outcomes``, ``logical_bytes`` and ``seconds`` have one entry per key this result
    answers for (the part's keys, in order; a result split by ``split_result``
    answers for the next run of them); ``stored_bytes`` one per such key, then one per
    key of the ``listed`` keys (a ``scan``: the size of each chunk found). ``flags``:
    :class:`ResultFlag` bits, as an int.

    A message: immutable (derive a changed copy with ``_replace``) and a tuple, which
    the C decoder fills in place (a dataclass's ``__init__`` took ~270 ns here, half of
    a small result's decode)."""

    __slots__ = ()

    job_id: WireJobId
    outcomes: list[Outcome]
    logical_bytes: list[int]
    stored_bytes: list[int]
    seconds: list[float]
    codec_s: float
    error: str
    listed: list[bytes]  # scan: the keys found
    more: bool
    flags: int

    def __new__(cls, job_id: WireJobId, outcomes: list[Outcome] | None = None,
                logical_bytes: list[int] | None = None, stored_bytes: list[int] | None = None,
                seconds: list[float] | None = None, codec_s: float = 0.0, error: str = "",
                listed: list[bytes] | None = None, more: bool = False,
                flags: int = 0) -> "Result":
        return tuple.__new__(cls, (
            job_id, [] if outcomes is None else outcomes,
            [] if logical_bytes is None else logical_bytes,
            [] if stored_bytes is None else stored_bytes, [] if seconds is None else seconds,
            codec_s, error, [] if listed is None else listed, more, flags))

    @classmethod
    def failed(cls, job_id: WireJobId | None, error: str, num_keys: int = 0) -> "Result":
        """A result failing every key of a job (ERROR; ``job_id`` None -> 0, unknown)."""
        return cls(WireJobId(job_id or 0), [Outcome.ERROR] * num_keys, [0] * num_keys,
                   [0] * num_keys, [0.0] * num_keys, error=error)


# msgpack.Packer keeps a buffer: one per thread.
_tls = threading.local()


def _packer() -> msgpack.Packer:
    try:
        return _tls.packer
    except AttributeError:
        _tls.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        return _tls.packer


def pack_job(job_id: WireJobId, op: str, tier: int, keys: list[bytes], rows: list[int] | tuple = (),
             args: dict[str, Any] | None = None) -> bytes:
    """Encode a job from its fields without building a :class:`Job` (the scheduler's hot path).

    Checks only the op name (ValueError); the rest is the caller's contract,
    enforced on the worker side by :func:`decode_job`.
    """
    try:
        code = OPS[op]
    except KeyError:
        raise ValueError(f"unknown job op {op!r} (accepted: {', '.join(OPS)})") from None
    if not args:  # the common job: encoded in C, byte for byte what msgpack writes
        packed = _pack_job_c(SCHEMA_VERSION, KIND_JOB, job_id, code, tier, keys, rows)
        if packed is not NotImplemented:
            return packed
    try:
        packer = _tls.packer
    except AttributeError:
        packer = _packer()
    return packer.pack([SCHEMA_VERSION, KIND_JOB, job_id, code, tier, keys, rows, args or {}])


def encode_job(job: Job) -> bytes:
    """Encode ``job`` (scheduler process)."""
    return pack_job(job.job_id, job.op, job.tier, job.keys, job.rows, job.args)


def _unpack(raw, what: str, error: type[MalformedJob]):
    try:
        return _unpackb(raw, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise error(f"malformed {what}: not a msgpack message "
                    f"({type(exc).__name__}: {exc})") from None


_unpackb = msgpack.unpackb


# Decoding takes a fast path that only *accepts* (a handful of type checks,
# C-speed where possible); anything it does not accept goes to the thorough
# checks below, which raise the precise error. tests/test_jobs.py checks that
# both agree.

def _args_ok(args: dict) -> bool:
    for name, value in args.items():
        if type(name) is not str:
            return False
        expected = ARG_TYPES.get(name)
        if expected is not None and (type(value) is not expected or
                                     (expected is int and value < 0)):
            return False
    return True


def _all_bytes(items: list) -> bool:
    if not items:
        return True
    try:
        b"".join(items)  # msgpack yields bytes for bin; any other type raises
    except TypeError:
        return False
    return True


def decode_job(raw) -> Job:
    """Decode one job (tier worker). Raises :class:`MalformedJob` naming the problem."""
    msg = _unpack(raw, "job", MalformedJob)
    if type(msg) is list and len(msg) == 8:
        v, kind, job_id, code, tier, keys, rows, args = msg
        if (type(v) is int and v == SCHEMA_VERSION and type(kind) is int and kind == KIND_JOB
                and type(job_id) is int and 0 <= job_id <= _UINT64_MAX
                and type(code) is int and type(tier) is int and tier >= 0
                and type(keys) is list and type(rows) is list and type(args) is dict):
            op = OP_NAMES.get(code)
            ok = op is not None and _all_bytes(keys) and (not args or _args_ok(args))
            if ok:
                for row in rows:
                    if type(row) is not int or row < 0:
                        ok = False
                        break
                if op in _ROW_OPS:
                    ok = ok and len(rows) == len(keys)
                else:
                    ok = ok and not rows and not (keys and op in _KEYLESS_OPS)
            if ok:
                return Job(job_id, op, tier, keys, rows, args)
    _diagnose_job(msg)
    raise MalformedJob("malformed job: rejected by the fast path only (a bug in jobs.py)")


def _check_header(msg, kind: int, length: int, what: str, error: type[MalformedJob]) -> int:
    """Check shape, version and kind; return the job id (raise naming the problem)."""
    if type(msg) is not list:
        raise error(f"malformed {what}: expected a msgpack array, got {type(msg).__name__}")
    job_id = msg[2] if len(msg) > 2 and type(msg[2]) is int and 0 <= msg[2] <= _UINT64_MAX else None
    if not msg or type(msg[0]) is not int:
        raise error(f"malformed {what}: no schema version", job_id)
    if msg[0] != SCHEMA_VERSION:
        raise error(f"malformed {what}: schema version {msg[0]}, this process speaks "
                    f"version {SCHEMA_VERSION}", job_id)
    kinds = {KIND_JOB: "job", KIND_RESULT: "result"}
    if len(msg) < 2 or type(msg[1]) is not int or msg[1] != kind:
        other = kinds.get(msg[1], "unknown") if len(msg) > 1 and type(msg[1]) is int else "unknown"
        raise error(f"malformed {what}: message kind is {other}, expected {what}", job_id)
    if len(msg) != length:
        raise error(f"malformed {what}: {len(msg)} fields, {length} expected", job_id)
    if job_id is None:
        raise error(f"malformed {what}: job_id must be an unsigned 64-bit int, "
                    f"got {msg[2]!r}")
    return job_id


def _bad(what: str, name: str, expected: str, value: Any, job_id, error=MalformedJob):
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return error(f"malformed {what} {job_id}: {name} must be {expected}, got "
                 f"{type(value).__name__} {shown}", job_id)


def _check_bytes_list(value, name: str, what: str, job_id, error) -> None:
    if type(value) is not list:
        raise _bad(what, name, "a list of bytes", value, job_id, error)
    for item in value:
        if type(item) is not bytes:
            raise _bad(what, f"each of {name}", "bytes", item, job_id, error)


def _diagnose_job(msg) -> None:
    """Raise MalformedJob naming what is wrong with decoded ``msg`` (returns if nothing is)."""
    job_id = _check_header(msg, KIND_JOB, 8, "job", MalformedJob)
    _, _, _, code, tier, keys, rows, args = msg
    op = OP_NAMES.get(code) if type(code) is int else None
    if op is None:
        raise _bad("job", "op", f"one of the codes {OPS}", code, job_id)
    if type(tier) is not int or tier < 0:
        raise _bad("job", "tier", "an int >= 0", tier, job_id)
    _check_bytes_list(keys, "keys", "job", job_id, MalformedJob)
    if type(rows) is not list:
        raise _bad("job", "rows", "a list of ints", rows, job_id)
    for row in rows:
        if type(row) is not int or row < 0:
            raise _bad("job", "each row", "an int >= 0", row, job_id)
    if type(args) is not dict:
        raise _bad("job", "args", "a map", args, job_id)
    for name, value in args.items():
        if type(name) is not str:
            raise _bad("job", "each args key", "a str", name, job_id)
        expected = ARG_TYPES.get(name)
        if expected is not None and (type(value) is not expected or
                                     (expected is int and value < 0)):
            wanted = f"{expected.__name__} (>= 0)" if expected is int else expected.__name__
            raise _bad("job", f"args[{name!r}]", wanted, value, job_id)
    if op in _ROW_OPS:
        if len(rows) != len(keys):
            raise MalformedJob(f"malformed job {job_id}: {op} needs one row per key, got "
                               f"{len(keys)} keys and {len(rows)} rows", job_id)
    elif rows:
        raise MalformedJob(f"malformed job {job_id}: {op} takes no rows, got {len(rows)}", job_id)
    if op in _KEYLESS_OPS and keys:
        raise MalformedJob(f"malformed job {job_id}: {op} takes no keys, got {len(keys)}", job_id)


_OUTCOMES = tuple(Outcome)  # indexed by code: what the decoders hand out
_NUM_OUTCOMES = len(_OUTCOMES)
_OUTCOME_BYTES = bytes(range(_NUM_OUTCOMES))


def _packed(fmt: str, values: list, name: str, job_id) -> bytes:
    """``values`` as a packed little-endian bin (``fmt`` "I": uint32, "f": float32)."""
    try:
        return struct.pack(f"<{len(values)}{fmt}", *values)
    except (struct.error, OverflowError, TypeError) as exc:
        kind = "ints in 0..2**32-1" if fmt == "I" else "floats in float32 range"
        raise ValueError(f"result {job_id}: {name} must be {kind} ({exc})") from None


def encode_result(result: Result) -> bytes:
    """Encode ``result`` (tier worker). ValueError if an outcome is not an
    :class:`Outcome`, a per-key list has the wrong length, a byte count or the flags
    do not fit 32 bits or a time is negative, NaN or beyond float32."""
    job_id = result.job_id
    n = len(result.outcomes)
    try:
        outcomes = bytes(result.outcomes)
    except (ValueError, TypeError):
        outcomes = None
    if outcomes is None or outcomes.translate(None, _OUTCOME_BYTES):
        raise ValueError(f"result {job_id}: outcomes must be codes 0..{_NUM_OUTCOMES - 1}, "
                         f"got {result.outcomes!r:.80}")
    if not (len(result.logical_bytes) == len(result.seconds) == n
            and len(result.stored_bytes) == n + len(result.listed)):
        raise ValueError(
            f"result {job_id}: {n} outcomes need as many logical_bytes and seconds, and "
            f"stored_bytes for them and the {len(result.listed)} listed keys; got "
            f"{len(result.logical_bytes)}, {len(result.seconds)} and "
            f"{len(result.stored_bytes)}")
    if not all(t >= 0.0 for t in result.seconds) or not result.codec_s >= 0.0:
        raise ValueError(f"result {job_id}: seconds and codec_s must be >= 0")
    flags = result.flags
    if isinstance(flags, bool) or not isinstance(flags, int) or not 0 <= flags <= _UINT32_MAX:
        raise ValueError(f"result {job_id}: flags must be an int in 0..2**32-1, got {flags!r}")
    try:
        packer = _tls.packer
    except AttributeError:
        packer = _packer()
    return packer.pack([
        SCHEMA_VERSION, KIND_RESULT, job_id, outcomes,
        _packed("I", result.logical_bytes, "logical_bytes", job_id),
        _packed("I", result.stored_bytes, "stored_bytes", job_id),
        _packed("f", result.seconds, "seconds", job_id),
        float(result.codec_s), result.error, result.listed, bool(result.more), int(flags),
    ])


def _unpack_u32(b: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(b) // 4}I", b))


def _unpack_f32(b: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(b) // 4}f", b))


def decode_result(raw) -> Result:
    """Decode one result (scheduler). Raises :class:`MalformedResult` naming the problem."""
    result = _decode_result_c(raw, SCHEMA_VERSION, KIND_RESULT, _OUTCOMES, Result)
    if result is not None:  # exactly what encode_result writes, every check passed (in C)
        return result
    msg = _unpack(raw, "result", MalformedResult)
    if type(msg) is list and len(msg) == 12:
        v, kind, job_id, outcomes, logical, stored, seconds, codec_s, error, keys, more, flags = msg
        if (type(v) is int and v == SCHEMA_VERSION and type(kind) is int and kind == KIND_RESULT
                and type(job_id) is int and 0 <= job_id <= _UINT64_MAX
                and type(outcomes) is bytes and not outcomes.translate(None, _OUTCOME_BYTES)
                and type(logical) is bytes and len(logical) == 4 * len(outcomes)
                and type(seconds) is bytes and len(seconds) == 4 * len(outcomes)
                and type(codec_s) is float and codec_s >= 0.0
                and type(error) is str and type(keys) is list and type(more) is bool
                and type(flags) is int and 0 <= flags <= _UINT32_MAX
                and type(stored) is bytes and len(stored) == 4 * (len(outcomes) + len(keys))
                and _all_bytes(keys)):
            secs = _unpack_f32(seconds)
            if all(t >= 0.0 for t in secs):
                return Result(job_id, [_OUTCOMES[c] for c in outcomes], _unpack_u32(logical),
                              _unpack_u32(stored), secs, codec_s, error, keys, more, flags)
    _diagnose_result(msg)
    raise MalformedResult("malformed result: rejected by the fast path only (a bug in jobs.py)")


def _diagnose_result(msg) -> None:
    """Raise MalformedResult naming what is wrong with decoded ``msg``."""
    err = MalformedResult
    job_id = _check_header(msg, KIND_RESULT, 12, "result", err)
    _, _, _, outcomes, logical, stored, seconds, codec_s, error, keys, more, flags = msg
    if type(outcomes) is not bytes:
        raise _bad("result", "outcomes", "bytes", outcomes, job_id, err)
    if outcomes and max(outcomes) >= _NUM_OUTCOMES:
        raise err(f"malformed result {job_id}: unknown outcome code {max(outcomes)} "
                  f"(known: 0..{_NUM_OUTCOMES - 1})", job_id)
    n = len(outcomes)
    _check_bytes_list(keys, "listed", "result", job_id, err)
    for name, value, want in (("logical_bytes", logical, n), ("stored_bytes", stored,
                                                              n + len(keys)),
                              ("seconds", seconds, n)):
        if type(value) is not bytes:
            raise _bad("result", name, "bytes (packed per key)", value, job_id, err)
        if len(value) != 4 * want:
            raise err(f"malformed result {job_id}: {name} holds {len(value)} bytes, "
                      f"expected {4 * want} (4 per key, {want} keys)", job_id)
    if not all(t >= 0.0 for t in _unpack_f32(seconds)):
        raise err(f"malformed result {job_id}: seconds must be >= 0 (a negative or NaN "
                  f"time)", job_id)
    if type(codec_s) is not float or not codec_s >= 0.0:
        raise _bad("result", "codec_s", "a float >= 0", codec_s, job_id, err)
    if type(error) is not str:
        raise _bad("result", "error", "a str", error, job_id, err)
    if type(more) is not bool:
        raise _bad("result", "more", "a bool", more, job_id, err)
    if type(flags) is not int or not 0 <= flags <= _UINT32_MAX:
        raise _bad("result", "flags", "an int in 0..2**32-1", flags, job_id, err)


# --- splitting ---

def _bin_size(n: int) -> int:
    return n + (2 if n < 256 else 3 if n < 65536 else 5)


def _uint_size(v: int) -> int:
    return 1 if v < 128 else 2 if v < 256 else 3 if v < 65536 else 5 if v < 1 << 32 else 9


def _array_header_extra(n: int) -> int:
    """Bytes an n-element array header takes beyond an empty array's one byte."""
    return 0 if n < 16 else 2 if n < 65536 else 4


def split_job(job: Job, max_bytes: int, next_id: Callable[[], int]) -> list[Job]:
    """Split ``job`` into parts whose encodings each fit ``max_bytes`` (scheduler).

    A job that fits comes back as ``[job]`` unchanged. Otherwise its keys (and
    the rows aligned with them) are cut into consecutive runs, in order, each
    part a valid job with the same op, tier and a copy of ``args``, and its
    own id from ``next_id()`` (e.g. ``itertools.count(1).__next__``). Never
    truncates: raises ValueError when a job without keys, or a single key,
    does not fit ``max_bytes`` (pass ``ring.max_payload``).
    """
    encoded = encode_job(job)
    if len(encoded) <= max_bytes:
        return [job]
    keys, rows = job.keys, job.rows
    aligned = len(rows) == len(keys) and bool(rows)
    if not keys:
        raise ValueError(f"job {job.job_id} ({job.op}) encodes to {len(encoded)} bytes, more "
                         f"than {max_bytes}, and has no keys to split by")
    if rows and not aligned:
        raise ValueError(f"job {job.job_id} ({job.op}): {len(rows)} rows for {len(keys)} keys; "
                         f"cannot split rows that are not aligned with keys")
    parts: list[Job] = []
    i, n = 0, len(keys)
    while i < n:
        part_id = next_id()
        base = len(pack_job(part_id, job.op, job.tier, [], [], job.args))
        size, j = base, i
        while j < n:
            cost = _bin_size(len(keys[j])) + (_uint_size(rows[j]) if aligned else 0)
            count = j - i + 1
            extra = _array_header_extra(count) * (2 if aligned else 1)
            if size + cost + extra > max_bytes:
                break
            size += cost
            j += 1
        if j == i:
            raise ValueError(
                f"job {job.job_id} ({job.op}): key {i} ({len(keys[i])} bytes) does not fit "
                f"{max_bytes} bytes even alone (a part without keys takes {base})"
            )
        part = Job(part_id, job.op, job.tier, keys[i:j], rows[i:j] if aligned else [],
                   dict(job.args))
        assert len(encode_job(part)) <= max_bytes, "split size accounting is off"
        parts.append(part)
        i = j
    return parts


def _result_growth(c: int, k: int, key_bytes: int) -> int:
    """Bytes that ``c`` answered keys' per-key data and ``k`` listed keys (whose bins
    take ``key_bytes``) add to a result that has neither."""
    return (_bin_size(c) + 2 * _bin_size(4 * c) + _bin_size(4 * (c + k)) - 4 * _bin_size(0)
            + key_bytes + _array_header_extra(k))


def _figure_fits(v) -> bool:
    return type(v) is int and 0 <= v <= _UINT32_MAX


def wire_figures(result: Result) -> Result:
    """``result`` with every per-key figure made one the wire carries (worker, before
    encoding; ``split_result`` calls it when the result does not encode as it is).

    An answered key whose ``logical_bytes`` or ``stored_bytes`` is not an int in
    0..``MAX_KEY_FIGURE`` fails alone: ERROR, its byte figures 0, the error text naming
    the key's position and the figure (a backend bug, or a chunk no layout has: its
    neighbours keep their outcomes). A listed key (a ``scan``) whose size does not fit
    is left out of the listing: it cannot be a chunk the scheduler could count (the error
    text stays as it is: a listing with an error is listed again). A time that is
    negative, NaN or beyond float32 becomes 0.0 (times inform, they decide nothing).
    Returns ``result`` itself when nothing needed changing."""
    n = len(result.outcomes)
    logical, stored, seconds = result.logical_bytes, result.stored_bytes, result.seconds
    bad = [i for i in range(min(n, len(logical), len(stored)))
           if not (_figure_fits(logical[i]) and _figure_fits(stored[i]))]
    listed = stored[n:]
    drop = [j for j, v in enumerate(listed) if not _figure_fits(v)]
    times = [t if (isinstance(t, (int, float)) and 0.0 <= t <= _F32_MAX) else 0.0
             for t in seconds]
    if not bad and not drop and times == list(seconds):
        return result
    outcomes, logical, answered = list(result.outcomes), list(logical), list(stored[:n])
    notes = []
    for i in bad:
        notes.append(f"key {i}: logical_bytes {logical[i]!r:.24}, stored_bytes "
                     f"{answered[i]!r:.24} (the wire carries 0..{_UINT32_MAX})")
        outcomes[i] = Outcome.ERROR
        logical[i] = answered[i] = 0
    error = result.error
    if notes:
        error = "; ".join(([error] if error else []) + notes[:3]
                          + ([f"{len(notes) - 3} more"] if len(notes) > 3 else []))
    keys = result.listed
    if drop:
        gone = set(drop)
        keys = [k for j, k in enumerate(keys) if j not in gone]
        listed = [v for j, v in enumerate(listed) if j not in gone]
    return result._replace(outcomes=outcomes, logical_bytes=logical,
                           stored_bytes=answered + listed, seconds=times, error=error,
                           listed=keys)


def split_result(result: Result, max_bytes: int) -> list[Result]:
    """Split a result that does not fit ``max_bytes`` (worker): a scan's long ``listed``
    listing, or per-key data of many (short) keys.

    Per-key figures the wire cannot carry are first made ones it can (``wire_figures``:
    such a key fails alone, such a listed key is left out), so one bad figure never
    fails its neighbours. A result that fits comes back as ``[result]``. Otherwise every part has the same
    job id and all but the last ``more=True``; the first carries ``codec_s``, the
    error text and the flags; each part answers for the next run of keys (outcomes, logical and
    stored bytes, seconds) and then lists the next run of ``listed`` keys with their stored
    sizes. An error text too long for one part is shortened (marked "[truncated]");
    keys and per-key data never are: ValueError when a single key cannot fit, or for
    what is wrong with the result besides its figures (``encode_result``).
    """
    try:
        encoded = encode_result(result)
    except ValueError:
        result = wire_figures(result)
        encoded = encode_result(result)
    if len(encoded) <= max_bytes:
        return [result]
    n = len(result.outcomes)
    keys, listed = result.listed, result.stored_bytes[n:]
    error = result.error
    first_cost = (_result_growth(1, 0, 0) if n else
                  _result_growth(0, 1, _bin_size(len(keys[0]))) if keys else 0)
    over = len(encode_result(Result(result.job_id, codec_s=result.codec_s, error=error,
                                    flags=result.flags))) \
        + first_cost - max_bytes
    if over > 0 and error:
        keep = max(0, len(error.encode()) - over - 16)
        error = error.encode()[:keep].decode(errors="ignore") + " [truncated]"
    parts: list[Result] = []
    i = j = 0  # the next answered key, the next listed key
    while True:
        head = Result(result.job_id, more=True) if parts else Result(
            result.job_id, codec_s=result.codec_s, error=error, more=True, flags=result.flags)
        base = len(encode_result(head))
        if base > max_bytes:
            raise ValueError(f"result {result.job_id}: its fields cannot fit {max_bytes} "
                             f"bytes (a part without keys takes {base})")
        c = 0
        while i + c < n and base + _result_growth(c + 1, 0, 0) <= max_bytes:
            c += 1
        k = key_bytes = 0
        while j + k < len(keys):
            cost = _bin_size(len(keys[j + k]))
            if base + _result_growth(c, k + 1, key_bytes + cost) > max_bytes:
                break
            key_bytes += cost
            k += 1
        if c == 0 and k == 0 and (i < n or j < len(keys)):
            what = (f"answered key {i}" if i < n else
                    f"listed key {j} ({len(keys[j])} bytes)")
            raise ValueError(f"result {result.job_id}: {what} cannot fit {max_bytes} bytes "
                             f"(a part without keys takes {base})")
        part = head._replace(
            outcomes=result.outcomes[i:i + c], logical_bytes=result.logical_bytes[i:i + c],
            stored_bytes=result.stored_bytes[i:i + c] + listed[j:j + k],
            seconds=result.seconds[i:i + c], listed=list(keys[j:j + k]))
        i += c
        j += k
        if i >= n and j >= len(keys):
            part = part._replace(more=result.more)
        assert len(encode_result(part)) <= max_bytes, "split size accounting is off"
        parts.append(part)
        if i >= n and j >= len(keys):
            return parts
