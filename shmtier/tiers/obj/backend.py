"""The worker half of the ``obj`` tier: chunks as verified objects in an S3 bucket.

Runs in: tier worker processes only, called by the job loop for one job at a time on
the worker's main thread. Every op blocks on HTTP requests (milliseconds on a LAN, up
to the configured timeouts and retries when the store is slow or gone); that is why it
never runs in the scheduler process. Imports neither torch nor vLLM (boto3 through
``client.py``).

Layout in the bucket::

    [<prefix>/]shmtier-<sha256(fingerprint)[:16]>/      namespace (chunk_names.py), as fs
        config.json                                     format, version, fingerprint
        <key hex[0:3]>/<key hex>.kv                     one chunk = one codec frame

An object's body is exactly the codec frame the fs tier writes as a file
(``shmtier.shared.codec``: magic, version, codec, lengths, the full key, CRC-32Cs and,
with a MAC key, a keyed BLAKE2b tag), so every check a file gets, an object gets.

Concurrency: a backend owns a thread pool of ``io_threads``; a batch's keys are encoded
and sent (store), fetched and verified (load) or probed ``io_threads`` at a time (zstd,
CRC-32C and socket I/O release the GIL), over one boto3 client whose connection pool
has as many connections. Each pool thread has its own encoders and decoder.

Size (over 600 lines): the worker half's store, load, probe, delete and listing share one
client, one retry rule and one object format.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from shmtier.shared.codec import (
    ChunkDecoder,
    ChunkEncoder,
    CompressionConfig,
    CorruptChunkError,
    frame_header_size,
    mac_key_id,
)
from shmtier.shared.codec_choice import CodecChooser
from shmtier.shared.jobs import ResultFlag
from shmtier.storage.chunk_names import (
    chunk_key,
    chunk_name,
    key_problem,
    namespace_dir_name,
    with_mac_id,
)
from shmtier.tiers.backend import (
    BatchResult,
    Outcome,
    ScanEntry,
    TierBackend,
    WorkerContext,
    as_arena,
    check_batch,
    row_problem,
)
from shmtier.tiers.obj.client import error_detail, import_boto3, make_client
from shmtier.tiers.obj.config import ObjTierConfig

logger = logging.getLogger(__name__)

FORMAT_NAME = "shmtier-obj"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
FANOUT_CHARS = 3  # key hex digits naming an object's "directory"
DELETE_BATCH = 1000  # S3's limit for one DeleteObjects


@dataclass
class ObjCounters:
    """Counters of one ObjBackend object (this process only; never reset by the backend).

    ``bytes_stored`` is what this process knows: set by a completed ``scan``, then
    raised by its own stores and lowered by its corrupt-object removals (a delete does not
    learn the sizes it frees: S3 does not say). It is ``store``'s ``max_bytes`` figure
    only when a job carries no ``bytes_in_use``; the scheduler half's index is the
    authoritative count."""

    bytes_stored: int = 0
    objects_written: int = 0
    bytes_written: int = 0  # stored (frame) bytes of objects put
    objects_read: int = 0
    bytes_read: int = 0  # stored bytes of verified objects
    objects_deleted: int = 0  # keys a DeleteObjects reported deleted
    store_full: int = 0  # REJECTED "max_bytes"
    store_errors: int = 0
    stores_raw_hurried: int = 0  # stored raw (mode "auto"): the worker behind, raw cheaper
    stores_raw_by_cost: int = 0  # stored raw (mode "auto"): a busy host, raw cheaper
    load_missing: int = 0
    load_errors: int = 0
    corrupt_objects_detected: int = 0
    corrupt_objects_removed: int = 0
    corrupt_remove_failed: int = 0  # detected, but the DELETE failed (left in the bucket)
    corrupt_by_reason: dict = field(default_factory=dict)
    delete_errors: int = 0
    probe_errors: int = 0
    scan_skipped: int = 0  # objects under the namespace that are not chunks of ours
    scan_errors: int = 0  # listings that failed
    config_write_deferred: int = 0  # config.json could not be read or written at open

    def as_dict(self) -> dict:
        return asdict(self)


class _KeyDone(NamedTuple):
    """One key's result, made by a pool thread and recorded by the calling thread."""

    outcome: Outcome
    detail: str = ""
    logical: int = 0
    stored: int = 0
    seconds: float = 0.0
    codec_s: float = 0.0
    note: str = ""  # what else happened, for the counters ("raw", "removed", ...)


class _Thread(threading.local):
    """A pool thread's codec objects (encoders and decoders are not thread-safe)."""

    encoder: ChunkEncoder | None = None
    raw_encoder: ChunkEncoder | None = None
    decoder: ChunkDecoder | None = None


class ObjBackend(TierBackend):
    """Chunks of one layout fingerprint stored as objects of one bucket.

    Construct once per tier worker process (``open``): one boto3 client, one thread pool.
    Several processes may use the same bucket and namespace at once (each object is
    written whole by one PUT; S3 makes it visible whole or not at all). Calls come from
    one thread (the job loop's); the backend spreads a batch over its pool.

    Construction reads ``config.json`` of the namespace and writes it when absent; a
    config.json naming another fingerprint or format raises ValueError, a bucket that
    refuses the request (403, no such bucket) raises RuntimeError. When the store cannot
    be reached then, the backend starts anyway (counted in ``config_write_deferred``) and
    writes config.json with a later store: a store that is down while workers start must
    not break the tier's pool.

    Every op blocks on the network: per request at most ``connect_timeout_s`` to connect
    and ``read_timeout_s`` per wait for bytes, ``max_attempts`` times with botocore's
    backoff between attempts. Ops never raise for a key's failure (per-key outcomes);
    ``scan`` raises when the listing fails (a partial listing is not an index).

    Capacity: ``store`` refuses a key (REJECTED, "max_bytes") whose frame would take the
    tier past ``max_bytes``: ``bytes_in_use`` (the job's figure, else this process's
    ``counters.bytes_stored``) plus the frames this batch already sent or is sending.
    The backend never evicts: the scheduler half decides what to delete.

    ``mac_key``: as for the fs tier: frames carry a keyed tag, loads serve only frames
    whose tag verifies, and the key's id is part of the namespace's fingerprint.
    """

    kind = "obj"

    def __init__(self, client: Any, bucket: str, namespace: str, *, prefix: str = "",
                 io_threads: int = ObjTierConfig.default("io_threads"), codec_config: CompressionConfig | None = None,
                 element_size: int = 2, max_bytes: int | None = None,
                 mac_key: bytes | None = None, endpoint: str = ""):
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"obj tier namespace must be a non-empty fingerprint string, "
                             f"got {namespace!r}")
        if not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"obj tier io_threads={io_threads!r}: must be an integer >= 1")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise ValueError(f"obj tier max_bytes={max_bytes!r}: must be a positive integer "
                             f"or None")
        if not isinstance(element_size, int) or not 1 <= element_size <= 255:
            raise ValueError(f"obj tier element_size={element_size!r}: must be an integer "
                             f"in 1..255")
        if prefix != prefix.strip("/") or "//" in prefix:
            raise ValueError(f"obj tier prefix={prefix!r}: no '/' at its ends, no '//'")
        self.mac_key_id = mac_key_id(mac_key) if mac_key is not None else None
        namespace = with_mac_id(namespace, self.mac_key_id)
        self.client = client
        self.bucket = bucket
        self.endpoint = endpoint
        self.fingerprint = namespace
        self.prefix = prefix
        self.base = "/".join(p for p in (prefix, namespace_dir_name(namespace)) if p)
        self.io_threads = io_threads
        self.codec_config = codec_config if codec_config is not None else CompressionConfig()
        self.element_size = element_size
        self.max_bytes = max_bytes
        self._mac_key = mac_key
        self.counters = ObjCounters()
        # mode "auto": compress or not by measured cost (shared/codec_choice.py), decided
        # once per store batch; its rates are measured by the I/O threads (EMAs of floats:
        # a lost update under the GIL only delays a measurement)
        self.chooser = (CodecChooser(f"obj {bucket}", self.codec_config.min_gain)
                        if self.codec_config.mode == "auto" else None)
        self._bx = import_boto3()[2]
        self._local = _Thread()
        self._lock = threading.Lock()  # the max_bytes reservations of a store batch
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            io_threads, thread_name_prefix="shmtier-obj")
        self._config_pending = True
        try:
            self._ensure_config(at_open=True)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, config: ObjTierConfig, context: WorkerContext) -> "ObjBackend":
        """A tier worker's backend for its tier's ``config``: builds the process's boto3
        client (no request) and the backend (reads or writes config.json: one or two
        requests)."""
        store = config.store_config
        client = make_client(config)
        try:
            return cls(client, store.bucket, context.namespace,
                       prefix=config.prefix, io_threads=config.io_threads,
                       codec_config=context.codec, element_size=context.element_size,
                       max_bytes=config.max_bytes, mac_key=config.mac_secret,
                       endpoint=store.endpoint_label())
        except BaseException:
            client.close()
            raise

    # ------------------------------------------------------------------ names

    def object_key(self, key: bytes) -> str:
        """The object that holds (or would hold) ``key``'s chunk:
        ``<base>/<hex[0:3]>/<hex>.kv``."""
        name = chunk_name(key)
        return f"{self.base}/{name[:FANOUT_CHARS]}/{name}"

    @property
    def config_key(self) -> str:
        return f"{self.base}/{CONFIG_NAME}"

    def _ensure_config(self, *, at_open: bool = False) -> None:
        """Read config.json, check its fingerprint, write it when absent. At open, a
        store that cannot be reached defers it (to the next store batch); a refusal (403,
        no such bucket) or another fingerprint raises."""
        bx = self._bx
        try:
            try:
                got = self.client.get_object(Bucket=self.bucket, Key=self.config_key)
                cfg = _parse_config(got["Body"].read())
            except bx.ClientError as e:
                if _status(e) != 404 or _code(e) == "NoSuchBucket":
                    raise
                cfg = None
            if cfg is None:
                body = json.dumps({
                    "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
                    "fingerprint": self.fingerprint,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }, indent=2, sort_keys=True).encode() + b"\n"
                self.client.put_object(Bucket=self.bucket, Key=self.config_key, Body=body,
                                       ContentType="application/json")
            else:
                self._check_config(cfg)
        except bx.ClientError as e:
            if _status(e) in (403, 404) or _code(e) == "NoSuchBucket":
                raise RuntimeError(
                    f"obj tier: bucket {self.bucket!r} at {self.endpoint} refuses "
                    f"{self.config_key}: {error_detail(e)}") from None
            if not at_open:
                return
            self._defer_config(e)
            return
        except (bx.BotoCoreError, OSError) as e:
            if not at_open:
                return
            self._defer_config(e)
            return
        self._config_pending = False

    def _retry_config(self) -> None:
        """config.json deferred at open: try again (a store batch's first step). Never
        raises: the batch's PUTs report what is wrong with the store."""
        try:
            self._ensure_config()
        except Exception as e:
            logger.warning("obj tier: %s at %s: config.json still not written (%s)",
                           self.bucket, self.endpoint, e)

    def _defer_config(self, e: BaseException) -> None:
        self.counters.config_write_deferred += 1
        logger.warning("obj tier: cannot reach %s at %s to read or write %s (%s); "
                       "starting anyway, the next store tries again", self.bucket,
                       self.endpoint, self.config_key, error_detail(e))

    def _check_config(self, cfg: Any) -> None:
        where = f"s3://{self.bucket}/{self.config_key}"
        if not isinstance(cfg, dict):
            raise ValueError(f"obj tier namespace config {where} is not a JSON object")
        if cfg.get("format") != FORMAT_NAME or cfg.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"obj tier namespace {where} holds format {cfg.get('format')!r} version "
                f"{cfg.get('format_version')!r}; this shmtier reads {FORMAT_NAME!r} "
                f"version {FORMAT_VERSION}")
        if cfg.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"obj tier namespace {where} belongs to another layout fingerprint "
                f"({cfg.get('fingerprint')!r}, expected {self.fingerprint!r}); refusing to "
                f"use it")

    # ------------------------------------------------------------------ threads

    def _codec(self) -> _Thread:
        """The calling pool thread's encoders and decoder (made on first use)."""
        t = self._local
        if t.decoder is None:
            t.encoder = ChunkEncoder(self.codec_config, mac_key=self._mac_key)
            t.raw_encoder = ChunkEncoder(CompressionConfig(mode="none"), mac_key=self._mac_key)
            t.decoder = ChunkDecoder(mac_key=self._mac_key)
        return t

    def _each(self, fn: Callable[..., _KeyDone], items: list[tuple]) -> list[_KeyDone]:
        """``fn(*item)`` for every item, ``io_threads`` at a time, in order. An exception
        ``fn`` did not turn into an outcome (a bug) fails its key, not the batch."""
        def run(item: tuple) -> _KeyDone:
            t = time.perf_counter()
            try:
                return fn(*item)
            except Exception as e:  # pragma: no cover - defensive
                return _KeyDone(Outcome.ERROR, f"{type(e).__name__}: {e}"[:200],
                                seconds=time.perf_counter() - t)
        if self._pool is None:
            raise RuntimeError("obj tier backend is closed")
        if len(items) <= 1 or self.io_threads == 1:
            return [run(item) for item in items]
        return list(self._pool.map(run, items))

    # ------------------------------------------------------------------ store

    def store(self, keys: Sequence[bytes], rows: Sequence[int], arena, chunk_bytes: int, *,
              bytes_in_use: int | None = None, hurry: bool = False,
              **_ignored: Any) -> BatchResult:
        """PUT row ``rows[i]`` (its first ``chunk_bytes``) as the object of ``keys[i]``.

        Called by the job loop of a tier worker for a cascade job; blocks on the network,
        ``io_threads`` keys at a time (each: encode, then one PUT of the whole frame, no
        HEAD before: storing a key again writes the same bytes). Rows are only read. Per
        key: OK (``stored_bytes`` = the object's size, ``logical_bytes`` = the chunk's
        bytes), REJECTED "max_bytes", ERROR (detail: ``"HTTP 503 SlowDown (put)"``,
        ``"connection refused (errno 111) (put)"``, ``"read timeout (put)"``... after
        botocore's retries), INVALID. ``bytes_in_use``: the scheduler's count of the
        tier's stored bytes, for the ``max_bytes`` check (else
        ``counters.bytes_stored``). ``hurry``: the worker is behind, an input of
        compression by cost in codec mode ``auto`` (decided once per batch,
        ``shared/codec_choice.py``), which may store raw frames (counted in
        ``stores_raw_hurried``, or ``stores_raw_by_cost`` when not behind). A key's seconds cover
        its encode and its PUT (with retries). Raises ValueError only for a malformed
        batch."""
        a = as_arena(arena)
        check_batch(keys, rows, a, chunk_bytes)
        n = len(keys)
        res = BatchResult.empty("store", n)
        if self._config_pending:
            self._retry_config()
        c = self.counters
        raw = self.chooser is not None and not self.chooser.compress_next(hurry)
        note = "raw" if hurry else "raw by cost"
        budget = [c.bytes_stored if bytes_in_use is None else int(bytes_in_use)]
        extra = (note if raw else "", budget)
        items = [(*item, *extra) for item in _valid_items(keys, rows, a, chunk_bytes, res)]
        for (i, *_), done in zip(items, self._each(self._store_one, items)):
            self._record(res, i, done)
            if done.note == "raw":
                c.stores_raw_hurried += 1
            elif done.note == "raw by cost":
                c.stores_raw_by_cost += 1
            if done.outcome is Outcome.OK:
                c.objects_written += 1
                c.bytes_written += done.stored
                c.bytes_stored += done.stored
            elif done.outcome is Outcome.REJECTED:
                c.store_full += 1
            elif done.outcome is Outcome.ERROR:
                c.store_errors += 1
        return res

    def _store_one(self, i: int, key: bytes, raw: memoryview, note: str,
                   budget: list[int]) -> _KeyDone:
        t = time.perf_counter()
        codec = self._codec()
        encoder = codec.raw_encoder if note else codec.encoder
        chooser = self.chooser
        since = chooser.clock() if chooser is not None else None
        parts, est = encoder.encode(raw, key, self.element_size)
        size = est.stored_bytes
        if chooser is not None:
            chooser.note_encode(not note, est.raw_bytes, size, since)
        if self.max_bytes is not None:
            with self._lock:
                if budget[0] + size > self.max_bytes:
                    return _KeyDone(Outcome.REJECTED, "max_bytes", seconds=time.perf_counter() - t,
                                    codec_s=est.seconds, note=note)
                budget[0] += size
        body = b"".join(parts)  # parts may be views of the encoder's scratch: copied here
        since = chooser.clock() if chooser is not None else None
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.object_key(key), Body=body)
        except Exception as e:
            if self.max_bytes is not None:
                with self._lock:
                    budget[0] -= size
            return _KeyDone(Outcome.ERROR, f"{error_detail(e)} (put)",
                            seconds=time.perf_counter() - t, codec_s=est.seconds, note=note)
        if chooser is not None:
            chooser.note_write(size, since)
        return _KeyDone(Outcome.OK, "", est.raw_bytes, size, time.perf_counter() - t,
                        est.seconds, note)

    # ------------------------------------------------------------------ load

    def load(self, keys: Sequence[bytes], rows: Sequence[int], arena,
             chunk_bytes: int) -> BatchResult:
        """GET and verify the object of ``keys[i]`` into row ``rows[i]`` (first ``chunk_bytes``).

        Called by the job loop of a tier worker for a promotion job; blocks on the
        network, ``io_threads`` keys at a time (each: one GET, the body read whole, then
        verified and decoded by the codec into the row). Per key: OK (the row holds the
        exact stored chunk), MISS (no such object), CORRUPT (detail: the codec's reason --
        ``magic``, ``key``, ``length``, ``checksum``, ``mac``...; a frame whose raw length
        is not ``chunk_bytes`` is ``length``; the object is deleted, counted, and never
        served), ERROR (the request failed after retries, or the body was cut short in
        transfer: the object is kept), INVALID. For any outcome but OK the row's first
        ``chunk_bytes`` are undefined and must not be served; bytes past ``chunk_bytes``
        are never written. The batch's rows must be distinct (pool threads write them at
        once). A key's seconds cover its GET and its decode."""
        a = as_arena(arena)
        check_batch(keys, rows, a, chunk_bytes)
        n = len(keys)
        res = BatchResult.empty("load", n)
        c = self.counters
        items = _valid_items(keys, rows, a, chunk_bytes, res)
        for (i, *_), done in zip(items, self._each(self._load_one, items)):
            self._record(res, i, done)
            if done.outcome is Outcome.OK:
                c.objects_read += 1
                c.bytes_read += done.stored
            elif done.outcome is Outcome.MISS:
                c.load_missing += 1
            elif done.outcome is Outcome.CORRUPT:
                c.corrupt_objects_detected += 1
                c.corrupt_by_reason[done.detail] = c.corrupt_by_reason.get(done.detail, 0) + 1
                if done.note == "removed":
                    c.corrupt_objects_removed += 1
                    c.bytes_stored = max(0, c.bytes_stored - done.stored)
                else:
                    c.corrupt_remove_failed += 1
            else:
                c.load_errors += 1
        return res

    def _load_one(self, i: int, key: bytes, out: memoryview) -> _KeyDone:
        t = time.perf_counter()
        bx = self._bx
        obj = self.object_key(key)
        decoder = self._codec().decoder
        chunk_bytes = out.nbytes
        hs = frame_header_size(len(key), mac=decoder.mac)
        cap = hs + chunk_bytes + chunk_bytes // 64 + 4096  # frames are never much larger
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=obj)
        except Exception as e:
            if isinstance(e, bx.ClientError) and (_status(e) == 404 or _code(e) == "NoSuchKey"):
                return _KeyDone(Outcome.MISS, seconds=time.perf_counter() - t)
            return _KeyDone(Outcome.ERROR, f"{error_detail(e)} (get)",
                            seconds=time.perf_counter() - t)
        body = got["Body"]
        size = int(got.get("ContentLength") or 0)
        reason = None
        frame = None
        try:
            if size < hs or size > cap:
                reason = "length"
            else:
                frame = body.read()
                if len(frame) != size:
                    raise OSError(f"body of {len(frame)} bytes, {size} announced")
        except Exception as e:  # cut short in transfer: not the object's fault
            return _KeyDone(Outcome.ERROR, f"{error_detail(e)} (read)",
                            seconds=time.perf_counter() - t)
        finally:
            body.close()
        codec_s = 0.0
        if reason is None:
            try:
                stats = decoder.decode_into(memoryview(frame), key, out)
                codec_s = stats.seconds
            except CorruptChunkError as e:
                reason = getattr(e, "reason", None) or "codec"
        if reason is not None:
            note = "removed"
            try:
                self.client.delete_object(Bucket=self.bucket, Key=obj)
            except Exception:
                note = "kept"
            return _KeyDone(Outcome.CORRUPT, reason, 0, size, time.perf_counter() - t,
                            codec_s, note)
        return _KeyDone(Outcome.OK, "", chunk_bytes, size, time.perf_counter() - t, codec_s)

    # ------------------------------------------------------------------ delete / probe

    def delete(self, keys: Sequence[bytes]) -> BatchResult:
        """Delete the objects of ``keys`` (scheduler-decided eviction): DeleteObjects in
        batches of up to 1000 keys, one after another. Blocks on the network.

        Per key: OK (S3 reports a key deleted whether or not it existed, so there is no
        MISS; ``stored_bytes`` 0: S3 does not say what was freed), ERROR (the key's error
        code from the answer, or the request's failure for every key of its batch),
        INVALID."""
        res = BatchResult.empty("delete", len(keys))
        c = self.counters
        valid = []
        for i, key in enumerate(keys):
            bad = key_problem(key)
            if bad is not None:
                res.set(i, Outcome.INVALID, bad)
            else:
                valid.append(i)
        for lo in range(0, len(valid), DELETE_BATCH):
            batch = valid[lo:lo + DELETE_BATCH]
            t = time.perf_counter()
            where: dict[str, list[int]] = {}
            for i in batch:
                where.setdefault(self.object_key(bytes(keys[i])), []).append(i)
            try:
                got = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in where], "Quiet": False})
            except Exception as e:
                detail = f"{error_detail(e)} (delete)"
                for i in batch:
                    res.set(i, Outcome.ERROR, detail)
                c.delete_errors += len(batch)
            else:
                for d in got.get("Deleted", ()):
                    for i in where.pop(d.get("Key"), ()):
                        res.set(i, Outcome.OK)
                        c.objects_deleted += 1
                for err in got.get("Errors", ()):
                    for i in where.pop(err.get("Key"), ()):
                        res.set(i, Outcome.ERROR, f"{err.get('Code') or 'error'} (delete)")
                        c.delete_errors += 1
                for idx in where.values():  # neither deleted nor failed: not answered
                    for i in idx:
                        res.set(i, Outcome.ERROR, "not in the DeleteObjects answer (delete)")
                        c.delete_errors += 1
            share = (time.perf_counter() - t) / len(batch)
            for i in batch:
                res.seconds[i] += share
        return res

    def probe(self, keys: Sequence[bytes]) -> BatchResult:
        """Presence by one HEAD per key, ``io_threads`` at a time, without reading: OK
        with ``stored_bytes`` = the object's size (present; not verified -- a corrupt
        object is found by ``load``), MISS (404), ERROR (any other failure, after
        retries), INVALID. Blocks on the network."""
        res = BatchResult.empty("probe", len(keys))
        items = []
        for i, key in enumerate(keys):
            bad = key_problem(key)
            if bad is not None:
                res.set(i, Outcome.INVALID, bad)
            else:
                items.append((i, bytes(key)))
        for (i, _), done in zip(items, self._each(self._probe_one, items)):
            self._record(res, i, done)
            if done.outcome is Outcome.ERROR:
                self.counters.probe_errors += 1
        return res

    def _probe_one(self, i: int, key: bytes) -> _KeyDone:
        t = time.perf_counter()
        try:
            got = self.client.head_object(Bucket=self.bucket, Key=self.object_key(key))
        except Exception as e:
            if isinstance(e, self._bx.ClientError) and _status(e) == 404:
                return _KeyDone(Outcome.MISS, seconds=time.perf_counter() - t)
            return _KeyDone(Outcome.ERROR, f"{error_detail(e)} (head)",
                            seconds=time.perf_counter() - t)
        return _KeyDone(Outcome.OK, "", 0, int(got.get("ContentLength") or 0),
                        time.perf_counter() - t)

    # ------------------------------------------------------------------ scan

    def scan(self) -> Iterator[ScanEntry]:
        """Yield every chunk object of the namespace: ``(key, stored_bytes, mtime)``.

        For the index rebuild after a (re)start: ListObjectsV2 pages (1000 objects each)
        under ``<base>/``, no reads, so objects are not verified (``load`` does that).
        Only names that parse as chunks in their own fan-out (``<hex[0:3]>/<hex>.kv``)
        are listed; anything else but config.json is skipped and counted
        (``scan_skipped``). When the listing completes, ``counters.bytes_stored`` is set
        to the total found. A failed page request (after retries) raises (counted in
        ``scan_errors``): the listing so far is incomplete and must not be taken as the
        tier's content."""
        c = self.counters
        start = f"{self.base}/"
        total = 0
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=start)
            for page in pages:
                for obj in page.get("Contents", ()) or ():
                    rest = obj["Key"][len(start):]
                    if rest == CONFIG_NAME:
                        continue
                    fan, _, name = rest.partition("/")
                    key = chunk_key(name)
                    if key is None or fan != name[:FANOUT_CHARS]:
                        c.scan_skipped += 1
                        continue
                    size = int(obj.get("Size") or 0)
                    modified = obj.get("LastModified")
                    mtime = modified.timestamp() if modified is not None else 0.0
                    total += size
                    yield ScanEntry(key, size, mtime)
        except Exception as e:
            c.scan_errors += 1
            raise RuntimeError(f"obj tier: listing s3://{self.bucket}/{start} at "
                               f"{self.endpoint} failed: {error_detail(e)}") from e
        c.bytes_stored = total

    # ------------------------------------------------------------------ misc

    @staticmethod
    def _record(res: BatchResult, i: int, done: _KeyDone) -> None:
        res.set(i, done.outcome, done.detail)
        res.logical_bytes[i] = done.logical
        res.stored_bytes[i] = done.stored
        res.seconds[i] += done.seconds
        res.codec_s += done.codec_s

    def take_flags(self) -> int:
        """``ResultFlag.COMPRESSION_OFF`` while compression by cost chose raw frames."""
        d = self.chooser.decision if self.chooser is not None else None
        return int(ResultFlag.COMPRESSION_OFF) if d is not None and not d.compress else 0

    def close(self) -> None:
        """Stop the thread pool (waiting for requests in flight, which end within the
        timeouts) and close the client's connections. Idempotent; a closed backend
        answers no further calls."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # pragma: no cover - closing is best effort
                pass

    def __repr__(self) -> str:
        return (f"ObjBackend(s3://{self.bucket}/{self.base}/ at {self.endpoint}, "
                f"io_threads={self.io_threads}, max_bytes={self.max_bytes}, "
                f"mac_key_id={self.mac_key_id})")


def _status(e: BaseException) -> int | None:
    return (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")


def _code(e: BaseException) -> str:
    return str((getattr(e, "response", None) or {}).get("Error", {}).get("Code", ""))


def _parse_config(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return "not JSON"


def _valid_items(keys, rows, a, chunk_bytes: int, res: BatchResult) -> list[tuple]:
    """``(index, key bytes, the row's chunk memory)`` of each key of a store or load batch
    whose key and row are valid; the others are set INVALID in ``res``, with the reason."""
    items = []
    for i in range(len(keys)):
        bad = key_problem(keys[i]) or row_problem(rows[i], a.shape[0])
        if bad is not None:
            res.set(i, Outcome.INVALID, bad)
        else:
            items.append((i, bytes(keys[i]), a[rows[i], :chunk_bytes].data))
    return items
