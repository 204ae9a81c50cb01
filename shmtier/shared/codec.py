"""Chunk frames: the byte format every secondary tier stores, and its codec.

A *frame* is one offloaded chunk as a tier stores it (a file of the ``fs``
tier, an object of ``obj``, a message of ``p2p``): a self-describing header
followed by the payload. The header names everything needed to check the frame
before a single byte of it reaches an arena row: magic, format version, codec,
element size, raw and stored lengths, the full key and a checksum of the raw
chunk bytes, plus a CRC-32C of its own, so that every flipped bit, truncation,
stale or misplaced frame is detected and reported as
:class:`CorruptChunkError` -- wrong KV is never served (docs/design.md §5 "fs format",
§8).

Layout (all integers little-endian; ``K`` = key length)::

    offset  size  field
         0     4  magic            FRAME_MAGIC = b"SMTK"
         4     1  version          FRAME_VERSION = 2
         5     1  codec id         0 raw, 1 zstd, 2 split_zstd
         6     1  element size     bytes per element of the chunk (1..255)
         7     1  flags            FLAG_MAC (1) or 0; any other bit: a newer writer
         8     2  key length K
        10     2  reserved         0
        12     4  checksum         CRC-32C of the raw bytes stored raw (see below)
        16     8  raw length       bytes of the decoded chunk
        24     8  stored length    bytes of payload after the header
        32     4  payload CRC      CRC-32C of the payload's zstd frame (0 for raw)
        36     4  header CRC       CRC-32C of bytes [0, 36) followed by the key
        40     K  key
      40+K    32  MAC tag          only with FLAG_MAC (see "Authentication" below)
      40+K(+32)   payload (stored length bytes)

Payload per codec, and what covers each raw byte:

* ``raw`` (0): the chunk bytes as they are (stored length = raw length);
  ``checksum`` is their CRC-32C.
* ``zstd`` (1): one zstd frame of the whole chunk (used for element sizes
  other than 2, and for 2-byte chunks of odd length); ``checksum`` is the
  CRC-32C of the raw chunk, verified over the bytes decoded into the
  destination, and ``payload CRC`` that of the zstd frame, verified before.
* ``split_zstd`` (2): for 2-byte elements (bf16/fp16): each little-endian
  element is split into its high byte (sign and exponent: low entropy) and its
  low byte (mantissa: near random); the payload is one zstd frame of the
  high-byte plane (``stored_len - raw_len // 2`` bytes) followed by the
  low-byte plane kept raw (``raw_len // 2`` bytes). ``checksum`` is the CRC-32C
  of the low-byte plane and ``payload CRC`` that of the zstd frame, so every
  stored bit is under a CRC; the decoded high-byte plane is checked by the zstd
  frame's own content checksum (the low 32 bits of XXH64, computed by libzstd
  while it compresses and verified by it while it decompresses, into scratch
  memory; a frame without one is refused). All are checked before the
  destination is written.

Authentication (optional, issue 11 item 7): the CRCs catch accidents, not intent --
anyone who can write a tier's medium can build a frame with valid CRCs for a key and
other bytes. An encoder and decoder given a ``mac_key`` (16..64 secret bytes) set
``FLAG_MAC`` and append a 32-byte BLAKE2b tag (``hashlib.blake2b``, keyed, digest size
32, personalisation ``b"shmtier-frame"``) to the header; the tag covers the header (its
fixed part with the header CRC, and the key) and the whole payload. A decoder with a key
refuses, as ``"mac"``, a frame without a tag or whose tag does not verify; a decoder
without a key refuses, as ``"mac"``, a frame that carries a tag (it cannot check what its
writer asked to be checked). The tag is verified after the payload CRCs (so bit rot
still reads ``"checksum"``; a flipped bit in the tag itself reads ``"mac"``) and before
any payload byte reaches zstd or the destination. Frames without ``FLAG_MAC`` are
byte for byte those of before. Cost (``bench/codec.py``): bench/README.md.

Why these choices (measured in ``bench/codec.py``, docs/design.md §5/§11): bf16 KV
compresses poorly as a whole (plain zstd level 1: ratio ~1.29) but its
high-byte plane is near its order-0 entropy bound with zstd's *fast*
strategy, min match 7 and hash log 6 -- finding matches in near-random data is
wasted work, Huffman coding of the literals is what pays -- giving ratio ~1.50
on random-normal bf16 at about twice the speed of level 1. A chunk is stored
raw when compression saves less than ``min_gain`` of its size. The split, the
merge and CRC-32C are the C extension ``_planes`` (one pass that splits a tile
and checksums its low plane while it is in cache; the SSE4.2 crc32
instruction); the split codec CRCs only what it stores (the low plane and the
compressed high plane, ~0.67 of the raw size) and lets libzstd, whose XXH64 is
nearly free, check the decoded high plane. Format version 1 (numpy split,
zlib's CRC-32 over the whole raw chunk as well) spent ~55% of its encode time
outside zstd; version 1 frames are refused as ``"version"`` (a tier treats
them as misses and removes them).

Who uses this module: tier worker processes (their backends encode on a
cascade and decode on a promotion), the bench, and tests. It imports neither
torch nor vLLM (tier workers stay under 100 MiB private RSS). Nothing here does
I/O, takes a lock or blocks on anything but the CPU; zstd and ``_planes``
release the GIL. An encoder or decoder is not
thread-safe: make one per thread (each holds a zstd context and scratch
buffers sized to the largest chunk it has seen: about 1x the chunk size plus
~2 MiB of zstd state).

Size (~690 lines): the frame format, its encoder and its decoder (with the optional MAC)
are one versioned format; keeping them together keeps every field's writer next to its
checks.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from shmtier.options import KeyedCheck, Options, integer, invalid, number, one_of, option
from shmtier.shared._planes import copy_crc32c, crc32c, merge, split

__all__ = [
    "FRAME_MAGIC", "FRAME_VERSION", "CODECS", "FLAG_MAC", "MAC_TAG_BYTES", "MAC_KEY_BYTES",
    "mac_key_id", "CorruptChunkError", "CompressionConfig",
    "ChunkEncoder", "ChunkDecoder", "EncodeStats", "DecodeStats", "FrameHeader",
    "frame_header_size", "parse_frame_header",
]

FRAME_MAGIC = b"SMTK"
FRAME_VERSION = 2

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_SPLIT_ZSTD = 2
CODECS = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_SPLIT_ZSTD: "split_zstd"}

MODES = ("auto", "zstd", "none")
MAX_KEY_LEN = 0xFFFF

#: Header flag: a MAC tag of MAC_TAG_BYTES follows the key (module docstring).
FLAG_MAC = 0x01
MAC_TAG_BYTES = 32
#: Accepted MAC key lengths (BLAKE2b takes at most 64; fewer than 16 is too weak).
MAC_KEY_BYTES = (16, 64)
_MAC_PERSON = b"shmtier-frame"
_KEY_ID_PERSON = b"shmtier-key-id"

# Fixed part of the header up to (not including) the header CRC; see the layout above.
_HEAD = struct.Struct("<4sBBBBHHIQQI")
_HCRC = struct.Struct("<I")
_FIXED_SIZE = _HEAD.size + _HCRC.size  # 40
assert _HEAD.size == 36 and _FIXED_SIZE == 40

# zstd parameters of the "auto" mode, tuned on random-normal bf16 high-byte planes
# (bench/codec.py): fast strategy, min match 7 (its maximum), hash log 6 (its minimum).
# A smaller hash table means fewer useless match probes in near-random data: faster
# and, measured, a slightly better ratio than hash log 8 (1.498 vs 1.496).
_AUTO_PARAMS = dict(strategy=zstandard.STRATEGY_FAST, min_match=7, hash_log=6)


class CorruptChunkError(Exception):
    """A frame failed a check; its bytes must not be served.

    ``reason`` is one of:

    * ``"magic"``    -- not a shmtier frame (or its first bytes are damaged);
    * ``"version"``  -- a format version (or flags) this code does not read;
    * ``"length"``   -- truncated or over-long frame, lengths that contradict each
      other, or a destination whose size is not the frame's raw length;
    * ``"key"``      -- an intact frame of another key;
    * ``"checksum"`` -- a header, payload or raw-bytes CRC mismatch (bit rot, torn write);
    * ``"codec"``    -- an unknown codec id, parameters the codec cannot have, or a
      payload zstd refuses or that decodes to the wrong size;
    * ``"mac"``      -- authentication failed: a decoder with a MAC key got a frame
      without a tag or with a tag that does not verify (forged, written under another
      key, or a flipped bit in the tag), or a decoder without a key got a frame with one.

    Raised by :func:`parse_frame_header` and :meth:`ChunkDecoder.decode_into`; a tier
    backend turns it into a MISS, removes the stored frame and counts it.
    """

    REASONS = ("magic", "version", "length", "key", "checksum", "codec", "mac")

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in self.REASONS:
            raise ValueError(
                f"unknown CorruptChunkError reason {reason!r}; one of {self.REASONS}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"corrupt chunk frame ({reason})" + (f": {detail}" if detail else ""))

    def __reduce__(self):  # picklable with its reason (results cross process boundaries)
        return (type(self), (self.reason, self.detail))


#: What ``compression`` is called in errors.
COMPRESSION_KEY = "kv_connector_extra_config['compression']"


@dataclass(frozen=True)
class CompressionConfig(Options):
    """How tier workers compress chunks (the config key ``compression``: a mode, or a
    mapping of the options below). Constructing one checks it too, so an invalid one
    raises ConfigError (a ValueError) naming the key, the value and what is accepted
    wherever it is made."""

    mode: str = option(
        "auto", one_of(*MODES),
        doc='"auto": byte-split + zstd with fast parameters tuned for KV for 2-byte '
            "elements, plain zstd otherwise, and a tier worker behind on stores (or on a busy "
            "host) stores raw where that costs it less time per byte; \"zstd\": zstd at "
            "level (byte-split for 2-byte elements); \"none\": every chunk raw (still framed "
            "and checksummed). Over a long run \"auto\" cost the tier workers ~1.5 s of CPU per "
            "GiB cascaded for ~0.72 of the bytes on disk (bench/README.md, \"Cost per byte "
            "over a long run\")")
    level: int = option(
        1, integer(1, zstandard.MAX_COMPRESSION_LEVEL), doc='the zstd level of mode "zstd"')
    min_gain: float = option(
        0.05, number(0, 1, max_open=True).then(float),
        doc="a chunk is stored compressed only if that saves at least this fraction of its "
            "raw size (and at least one byte)")

    def __post_init__(self) -> None:
        for f in self.declared():
            f.metadata["check"](f"{COMPRESSION_KEY}.{f.name}", getattr(self, f.name))

    @classmethod
    def accepted(cls) -> str:
        return f"{cls.declared()[0].metadata['check'].accepted} (a mode), or {cls.accepted_keys()}"

    @classmethod
    def from_config(cls, value: Any) -> "CompressionConfig":
        """Parse the config value of ``compression``.

        Accepts ``None`` (key absent: defaults), a mode string (``"auto"``, ``"zstd"``,
        ``"none"``), a mapping with any of ``mode``, ``level``, ``min_gain``, or a
        ``CompressionConfig``. Anything else raises ConfigError (a ``ValueError``) naming
        the key (``compression``, or the mapping's key), the value and what is accepted.
        Called at construction time, in any process, before anything is created; pure,
        never blocks.
        """
        if value is None:
            return cls()
        if isinstance(value, CompressionConfig):
            return value
        if isinstance(value, str) and value in MODES:
            return cls(mode=value)
        if isinstance(value, Mapping):
            return cls.from_mapping(value, where=COMPRESSION_KEY)
        raise invalid(COMPRESSION_KEY, value, cls.accepted())

    @classmethod
    def check(cls) -> KeyedCheck:
        """The check of a config field holding a CompressionConfig (``compression``)."""
        return KeyedCheck(cls.accepted, lambda key, value: cls.from_config(value),
                          to_plain=cls.to_dict, from_plain=cls.from_dict)


@dataclass(frozen=True)
class _CodecStats:
    """What one encode or decode did: ``raw_bytes`` (the chunk), ``stored_bytes`` (the
    whole frame, header + payload), ``seconds``, ``codec``."""

    raw_bytes: int
    stored_bytes: int
    seconds: float
    codec: str = "raw"


class EncodeStats(_CodecStats):
    """What one :meth:`ChunkEncoder.encode` did.

    ``raw_bytes``: chunk size; ``stored_bytes``: whole frame size (header + payload,
    what the tier writes); ``seconds``: CPU wall time of the encode (split, zstd,
    checksums); ``codec``: the codec chosen (``"raw"``, ``"zstd"``, ``"split_zstd"``).
    """


class DecodeStats(_CodecStats):
    """What one :meth:`ChunkDecoder.decode_into` did: ``raw_bytes`` written to the
    destination, ``stored_bytes`` of the frame read, ``seconds`` spent, ``codec``."""


@dataclass(frozen=True)
class FrameHeader:
    """A parsed and verified frame header (header CRC, magic, version, codec checked).

    ``stored_len`` is the payload size; ``header_size + stored_len`` (``frame_size``)
    is the whole frame. ``checksum`` is the CRC-32C of the raw bytes the codec stores
    raw (the whole chunk for ``raw`` and ``zstd``, the low-byte plane for
    ``split_zstd``), ``payload_crc`` that of the zstd payload (codec ``zstd`` only; 0
    otherwise). ``tag`` is the frame's MAC tag (``FLAG_MAC``), ``b""`` without one.
    See the module docstring.
    """

    magic: bytes
    version: int
    codec: str
    element_size: int
    raw_len: int
    stored_len: int
    key: bytes
    checksum: int
    payload_crc: int = 0
    tag: bytes = b""

    @property
    def header_size(self) -> int:
        return _FIXED_SIZE + len(self.key) + len(self.tag)

    @property
    def frame_size(self) -> int:
        return self.header_size + self.stored_len


def frame_header_size(key_len: int, *, mac: bool = False) -> int:
    """Bytes of the header of a frame whose key is ``key_len`` bytes long (40 + key_len,
    plus ``MAC_TAG_BYTES`` for a frame with a MAC tag).

    A backend that reads a frame in two steps reads this many bytes first, parses
    them with :func:`parse_frame_header`, then reads ``stored_len`` more."""
    if not 0 <= key_len <= MAX_KEY_LEN:
        raise ValueError(f"key length {key_len} out of range 0..{MAX_KEY_LEN}")
    return _FIXED_SIZE + key_len + (MAC_TAG_BYTES if mac else 0)


def _mac_state(mac_key: Any) -> "hashlib._Hash | None":
    """The keyed BLAKE2b state every frame's tag starts from (copied per frame), or None
    without a key. Raises TypeError / ValueError (naming the length, never the key) for
    a key that is not 16..64 bytes."""
    if mac_key is None:
        return None
    if not isinstance(mac_key, (bytes, bytearray, memoryview)):
        raise TypeError(f"mac_key must be bytes or None, got {type(mac_key).__name__}")
    key = bytes(mac_key)
    lo, hi = MAC_KEY_BYTES
    if not lo <= len(key) <= hi:
        raise ValueError(f"a MAC key of {len(key)} bytes; expected {lo}..{hi} bytes")
    return hashlib.blake2b(key=key, digest_size=MAC_TAG_BYTES, person=_MAC_PERSON)


def mac_key_id(mac_key: bytes) -> str:
    """16 hex digits that name a MAC key without revealing anything about it (a keyed
    BLAKE2b of nothing, under its own personalisation): equal keys, equal ids. The fs
    tier puts it in its namespace, so engines with different keys never share files."""
    _mac_state(mac_key)  # the same checks
    return hashlib.blake2b(key=bytes(mac_key), digest_size=8,
                           person=_KEY_ID_PERSON).hexdigest()


def _byte_view(buf: Any, *, writable: bool = False, what: str = "buffer") -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if writable and mv.readonly:
        raise ValueError(f"{what} must be writable")
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def parse_frame_header(buf: memoryview) -> FrameHeader:
    """Parse and verify the header at the start of ``buf`` (the whole frame or at
    least :func:`frame_header_size` bytes of it).

    Checks, in order: enough bytes for the fixed part (``"length"``), magic
    (``"magic"``), version (``"version"``), enough bytes for the key (``"length"``),
    header CRC over the fixed part and the key (``"checksum"``), reserved fields
    (``"version"``), codec id and its parameters (``"codec"``), and lengths
    consistent with the codec (``"length"``). Does not look at the payload.
    Callable from any process and thread; pure, never blocks.
    """
    mv = _byte_view(buf, what="frame")
    if mv.nbytes < _FIXED_SIZE:
        raise CorruptChunkError("length", f"{mv.nbytes} bytes, shorter than a frame header")
    (magic, version, codec_id, element_size, flags, key_len, reserved, checksum,
     raw_len, stored_len, payload_crc) = _HEAD.unpack_from(mv, 0)
    if magic != FRAME_MAGIC:
        raise CorruptChunkError("magic", f"magic {magic!r}, expected {FRAME_MAGIC!r}")
    if version != FRAME_VERSION:
        raise CorruptChunkError(
            "version", f"format version {version}, this code reads {FRAME_VERSION}")
    end = _FIXED_SIZE + key_len
    if mv.nbytes < end:
        raise CorruptChunkError("length", f"{mv.nbytes} bytes, header with its key needs {end}")
    (header_crc,) = _HCRC.unpack_from(mv, _HEAD.size)
    key = bytes(mv[_FIXED_SIZE:end])
    if crc32c(key, crc32c(mv[:_HEAD.size])) != header_crc:
        raise CorruptChunkError("checksum", "header CRC mismatch")
    if flags & ~FLAG_MAC or reserved:
        raise CorruptChunkError(
            "version", f"flags {flags:#x} / reserved {reserved:#x} not understood")
    tag = b""
    if flags & FLAG_MAC:
        if mv.nbytes < end + MAC_TAG_BYTES:
            raise CorruptChunkError(
                "length", f"{mv.nbytes} bytes, header with its key and MAC tag needs "
                          f"{end + MAC_TAG_BYTES}")
        tag = bytes(mv[end:end + MAC_TAG_BYTES])
    codec = CODECS.get(codec_id)
    if codec is None:
        raise CorruptChunkError("codec", f"unknown codec id {codec_id}")
    if element_size < 1:
        raise CorruptChunkError("codec", "element size 0")
    if codec_id == CODEC_RAW:
        if stored_len != raw_len:
            raise CorruptChunkError("length", f"raw frame stores {stored_len} bytes for {raw_len}")
    elif codec_id == CODEC_SPLIT_ZSTD:
        if element_size != 2 or raw_len % 2:
            raise CorruptChunkError(
                "codec", f"split_zstd with element size {element_size} and raw length {raw_len}")
        if stored_len <= raw_len // 2:
            raise CorruptChunkError(
                "length", f"split_zstd payload of {stored_len} bytes for {raw_len}")
    elif stored_len == 0:
        raise CorruptChunkError("length", "empty zstd payload")
    return FrameHeader(magic, version, codec, element_size, raw_len, stored_len, key,
                       checksum, payload_crc, tag)


class _Scratch:
    """Reusable uint8 arrays, grown (never shrunk) to the largest size requested."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int) -> np.ndarray:
        a = self._arrays.get(name)
        if a is None or a.size < n:
            a = np.empty(n, dtype=np.uint8)
            self._arrays[name] = a
        return a[:n]


class ChunkEncoder:
    """Encodes chunks into frames. One per worker thread (not thread-safe).

    Called by tier-worker backends (cascade/store path) in the tier worker process,
    and by the bench. CPU-bound: never does I/O, never waits on anything else.

    ``mac_key``: 16..64 secret bytes, or None. With a key every frame carries a MAC
    tag (``FLAG_MAC``; module docstring, "Authentication").
    """

    def __init__(self, config: CompressionConfig | None = None, *,
                 mac_key: bytes | None = None) -> None:
        self.config = config if config is not None else CompressionConfig()
        if not isinstance(self.config, CompressionConfig):
            raise TypeError(
                "config must be a CompressionConfig (use CompressionConfig.from_config)")
        self._mac = _mac_state(mac_key)
        # Two compressors that differ only in the zstd content checksum: the split
        # codec's high plane relies on it; whole-chunk zstd has CRC-32Cs of its own.
        self._cctx = self._cctx_split = None
        if self.config.mode != "none":
            self._cctx = self._compressor(write_checksum=False)
            self._cctx_split = self._compressor(write_checksum=True)
        # A compressed payload is kept when stored <= raw * (1 - min_gain).
        self._keep_factor = 1.0 - self.config.min_gain
        self._scratch = _Scratch()

    def _compressor(self, *, write_checksum: bool) -> zstandard.ZstdCompressor:
        common = dict(write_content_size=True, write_checksum=write_checksum,
                      write_dict_id=False)
        if self.config.mode == "auto":
            return zstandard.ZstdCompressor(
                compression_params=zstandard.ZstdCompressionParameters(**common, **_AUTO_PARAMS))
        return zstandard.ZstdCompressor(level=self.config.level, **common)

    @property
    def mac(self) -> bool:
        """True if this encoder writes MAC tags."""
        return self._mac is not None

    def _keep(self, stored: int, raw: int) -> bool:
        return stored < raw and stored <= raw * self._keep_factor

    def encode(self, raw: memoryview, key: bytes, element_size: int) -> tuple[list, EncodeStats]:
        """Frame ``raw`` (one chunk, e.g. an arena row slice) under ``key``.

        ``element_size``: bytes per element of the KV dtype (2 for bf16/fp16, 1 for
        fp8/int8, 4 for fp32); 2 enables the byte-split codec.

        Returns ``(parts, stats)``: ``parts`` is the frame as a list of bytes-like
        objects, header first, to write in order (``os.writev``, ``sock.sendmsg``, or
        ``b"".join`` for an object store). A part may be a view of ``raw`` (raw frames)
        or of this encoder's scratch buffer (the low-byte plane): the parts are valid
        until the next ``encode`` on this encoder and as long as ``raw`` is unchanged.
        ``raw`` is only read. Raises ``ValueError`` on a bad key or element size.
        """
        t0 = time.perf_counter()
        mv, key = _checked_input(raw, key, element_size)
        n = mv.nbytes
        codec_id = CODEC_RAW
        payload: list = [mv] if n else []
        payload_crc = 0
        stored = n
        if self._cctx is not None and n and element_size == 2 and n % 2 == 0:
            half = n // 2
            hi = self._scratch.get("hi", half)
            lo = self._scratch.get("lo", half)
            lo_crc = split(mv, hi, lo)
            comp = self._cctx_split.compress(hi)
            if self._keep(len(comp) + half, n):
                codec_id, stored = CODEC_SPLIT_ZSTD, len(comp) + half
                payload = [comp, memoryview(lo)]
                checksum, payload_crc = lo_crc, crc32c(comp)
            else:
                checksum = crc32c(mv)
        elif self._cctx is not None and n:
            comp = self._cctx.compress(mv)
            checksum = crc32c(mv)  # after zstd: the chunk's tail is still in cache
            if self._keep(len(comp), n):
                codec_id, stored = CODEC_ZSTD, len(comp)
                payload = [comp]
                payload_crc = crc32c(comp)
        else:
            checksum = crc32c(mv)
        header = self._header(codec_id, element_size, key, checksum, n, stored, payload_crc,
                              payload)
        stats = EncodeStats(n, len(header) + stored, time.perf_counter() - t0, CODECS[codec_id])
        return [header, *payload], stats

    def encode_raw_into(self, raw: memoryview, key: bytes, element_size: int,
                        out: memoryview) -> EncodeStats:
        """Frame ``raw`` as a raw frame (codec ``raw``, whatever this encoder's mode) written
        whole at the start of ``out`` (writable, at least ``frame_header_size(len(key),
        mac=self.mac) + len(raw)`` bytes): the payload is copied and checksummed in one
        pass (``copy_crc32c``), then the header written before it. For a writer that
        gathers the frame into a buffer of its own anyway (the fs tier's O_DIRECT stores):
        one pass over the chunk where ``encode`` and a gather of its parts take a CRC pass
        and a copy. The same frame, byte for byte, as ``encode`` makes raw. Returns its
        stats (stored = the frame's size); ValueError as ``encode``, or when ``out`` is too
        short."""
        t0 = time.perf_counter()
        mv, key = _checked_input(raw, key, element_size)
        n = mv.nbytes
        hs = frame_header_size(len(key), mac=self._mac is not None)
        omv = _byte_view(out, writable=True, what="out")
        if omv.nbytes < hs + n:
            raise ValueError(f"out holds {omv.nbytes} bytes; the frame needs {hs + n}")
        checksum = copy_crc32c(omv[hs:hs + n], mv) if n else crc32c(mv)
        payload = [omv[hs:hs + n]] if n else []
        omv[:hs] = self._header(CODEC_RAW, element_size, key, checksum, n, n, 0, payload)
        return EncodeStats(n, hs + n, time.perf_counter() - t0, CODECS[CODEC_RAW])

    def _header(self, codec_id: int, element_size: int, key: bytes, checksum: int, n: int,
                stored: int, payload_crc: int, payload: list) -> bytes:
        """A frame's header (with its MAC tag over the header and ``payload``, this
        encoder having a key)."""
        flags = 0 if self._mac is None else FLAG_MAC
        head = _HEAD.pack(FRAME_MAGIC, FRAME_VERSION, codec_id, element_size, flags, len(key),
                          0, checksum, n, stored, payload_crc)
        header = head + _HCRC.pack(crc32c(key, crc32c(head))) + key
        if self._mac is not None:
            mac = self._mac.copy()
            mac.update(header)
            for part in payload:
                mac.update(part)
            header += mac.digest()
        return header


def _checked_input(raw, key, element_size: int) -> tuple[memoryview, bytes]:
    """An encoder's input checked: (``raw`` as a byte view, ``key`` as bytes); ValueError
    for a key over ``MAX_KEY_LEN`` bytes or an element size outside 1..255."""
    mv = _byte_view(raw, what="raw")
    key = bytes(key)
    if len(key) > MAX_KEY_LEN:
        raise ValueError(f"key of {len(key)} bytes; at most {MAX_KEY_LEN}")
    if isinstance(element_size, bool) or not isinstance(element_size, int) \
            or not 1 <= element_size <= 255:
        raise ValueError(f"element_size={element_size!r}: expected an integer in 1..255")
    return mv, key


class ChunkDecoder:
    """Verifies frames and decodes them into destination buffers (arena rows).
    One per worker thread (not thread-safe).

    Called by tier-worker backends (promotion/load path) in the tier worker
    process, and by the bench. CPU-bound: never does I/O, never waits.

    ``mac_key``: 16..64 secret bytes, or None. With a key only frames whose MAC tag
    verifies under it are served; without one, frames with a tag are refused (module
    docstring, "Authentication"). Either refusal is ``"mac"``. ``ignore_mac`` (tools
    that check a MAC'd namespace without its key, never a tier): a tag is neither
    required nor checked; everything else is.
    """

    def __init__(self, *, mac_key: bytes | None = None, ignore_mac: bool = False) -> None:
        self._dctx = zstandard.ZstdDecompressor()
        self._scratch = _Scratch()
        self._mac = _mac_state(mac_key)
        if ignore_mac and self._mac is not None:
            raise ValueError("ignore_mac is for a decoder without a MAC key")
        # Tools only (``shmtier fsck`` of a MAC'd namespace without its key): every check
        # but the tag's (its presence is the caller's to judge). Never for serving.
        self._ignore_mac = ignore_mac

    @property
    def mac(self) -> bool:
        """True if this decoder requires (and checks) MAC tags."""
        return self._mac is not None

    def decode_into(self, frame: memoryview, key: bytes, out: memoryview) -> DecodeStats:
        """Verify ``frame`` (exactly one whole frame) as the frame of ``key`` and write
        its raw bytes into ``out`` (writable, ``len(out)`` == the frame's raw length).

        Order: header (see :func:`parse_frame_header`), key (``"key"``), frame length
        (``"length"``), destination length (``"length"``), a MAC tag present exactly
        when this decoder has a key (``"mac"``), then the payload's checks -- the raw
        bytes' CRC (``raw``), the payload CRC (``zstd``), the low plane's CRC
        (``split_zstd``), then the MAC tag (``"mac"``), then the high plane's zstd
        content checksum, decoded into scratch memory (``split_zstd``) -- all before
        ``out`` is written, so a corrupt stored frame
        leaves ``out`` untouched. A payload zstd refuses is ``"codec"``, a content
        checksum mismatch ``"checksum"``. For ``zstd`` it then checks the CRC of the
        bytes decoded into ``out`` (``"checksum"``); that can only fail on a decoder
        fault, and then ``out`` holds garbage: on any :class:`CorruptChunkError` the
        caller must not publish ``out``.
        """
        t0 = time.perf_counter()
        fmv = _byte_view(frame, what="frame")
        omv = _byte_view(out, writable=True, what="out")
        h = parse_frame_header(fmv)
        self._check_header(h, key, fmv.nbytes, omv.nbytes)
        hs = h.header_size
        payload = fmv[hs:]
        if h.codec == "raw":
            if crc32c(payload) != h.checksum:
                raise CorruptChunkError("checksum", "raw bytes CRC mismatch")
            self._authenticate(fmv, payload, h)
            omv[:] = payload  # only once the CRC passed: a corrupt frame writes nothing
        elif h.codec == "zstd":
            if crc32c(payload) != h.payload_crc:
                raise CorruptChunkError("checksum", "payload CRC mismatch")
            self._authenticate(fmv, payload, h)
            self._decompress(payload, omv)
            if crc32c(omv) != h.checksum:
                raise CorruptChunkError("checksum", "decoded bytes CRC mismatch")
        else:
            half = h.raw_len // 2
            comp = payload[:h.stored_len - half]
            if crc32c(comp) != h.payload_crc:
                raise CorruptChunkError("checksum", "payload CRC mismatch")
            lo = payload[h.stored_len - half:]
            if crc32c(lo) != h.checksum:
                raise CorruptChunkError("checksum", "low-byte plane CRC mismatch")
            self._authenticate(fmv, payload, h)
            hi = self._scratch.get("hi", half)
            self._decompress(comp, memoryview(hi), checksummed=True)
            merge(hi, lo, omv)
        return DecodeStats(h.raw_len, fmv.nbytes, time.perf_counter() - t0, h.codec)

    def decode_copying(self, frame: memoryview, key: bytes, out: memoryview) -> DecodeStats:
        """:meth:`decode_into`, but a raw frame's payload is copied into ``out`` while it is
        checksummed (one pass, ``copy_crc32c``) and judged after: for a reader whose frame
        sits in a buffer of its own (the fs tier's O_DIRECT loads), one pass over the chunk
        where a check and then a copy make two. The same checks in the same order; on a
        :class:`CorruptChunkError` of a raw frame ``out`` holds the frame's unverified bytes
        and must not be published (as with :meth:`decode_raw_in_place`). Other codecs are
        :meth:`decode_into`'s."""
        t0 = time.perf_counter()
        fmv = _byte_view(frame, what="frame")
        omv = _byte_view(out, writable=True, what="out")
        h = parse_frame_header(fmv)
        if h.codec != "raw":
            return self.decode_into(fmv, key, omv)
        self._check_header(h, key, fmv.nbytes, omv.nbytes)
        payload = fmv[h.header_size:]
        if (copy_crc32c(omv, payload) if payload.nbytes else crc32c(payload)) != h.checksum:
            raise CorruptChunkError("checksum", "raw bytes CRC mismatch")
        self._authenticate(fmv, payload, h)
        return DecodeStats(h.raw_len, fmv.nbytes, time.perf_counter() - t0, h.codec)

    def decode_raw_in_place(self, head: memoryview, key: bytes, out: memoryview,
                            frame_size: int) -> DecodeStats | None:
        """Verify a raw frame whose payload was read straight into ``out`` (the
        destination row: one vectored read of the header into ``head`` and the payload into
        ``out``, no copy). ``head``: the frame's first ``frame_header_size`` bytes;
        ``frame_size``: the whole frame's size as read. The same checks as
        :meth:`decode_into` for a raw frame, in the same order, but ``out`` already holds the
        payload, so on a :class:`CorruptChunkError` it holds those (unverified) bytes and must
        not be published. Returns None, checking nothing more, when the header is sound but
        names another codec (its payload, now in ``out``, is then to be read again and
        decoded with :meth:`decode_into`)."""
        t0 = time.perf_counter()
        hmv = _byte_view(head, what="head")
        omv = _byte_view(out, writable=True, what="out")
        h = parse_frame_header(hmv)
        if hmv.nbytes != h.header_size:
            raise CorruptChunkError(
                "length", f"header read has {hmv.nbytes} bytes, header says {h.header_size}")
        self._check_header(h, key, frame_size, omv.nbytes)
        if h.codec != "raw":
            return None
        if crc32c(omv) != h.checksum:
            raise CorruptChunkError("checksum", "raw bytes CRC mismatch")
        self._authenticate(hmv, omv, h)
        return DecodeStats(h.raw_len, frame_size, time.perf_counter() - t0, h.codec)

    def _check_header(self, h: FrameHeader, key: bytes, frame_size: int,
                      out_size: int) -> None:
        """The checks every decode makes before touching the payload: the frame is of
        ``key``, ``frame_size`` bytes long as its header says, its raw length is
        ``out_size``, and it carries a MAC tag exactly when this reader has a key (unless
        ``ignore_mac``)."""
        key = bytes(key)
        if h.key != key:
            raise CorruptChunkError("key", f"frame holds key {h.key.hex()}, expected {key.hex()}")
        whole = h.header_size + h.stored_len
        if frame_size != whole:
            raise CorruptChunkError("length", f"frame has {frame_size} bytes, header says {whole}")
        if out_size != h.raw_len:
            raise CorruptChunkError(
                "length", f"destination has {out_size} bytes, frame holds {h.raw_len}")
        if bool(h.tag) != (self._mac is not None) and not self._ignore_mac:
            raise CorruptChunkError("mac", "frame carries a MAC tag this reader has no key "
                                           "to check" if h.tag else "frame carries no MAC tag")

    def _authenticate(self, head: memoryview, payload: memoryview, h: FrameHeader) -> None:
        """Check the MAC tag of a frame (header ``h``; ``head`` starts with its header,
        ``payload`` is its payload), if this decoder has a key: BLAKE2b over the header up
        to the tag and the payload."""
        if self._mac is None:
            return
        mac = self._mac.copy()
        mac.update(head[:h.header_size - MAC_TAG_BYTES])
        mac.update(payload)
        if not hmac.compare_digest(mac.digest(), h.tag):
            raise CorruptChunkError("mac", "MAC tag does not verify (forged, or written "
                                           "under another key)")

    def _decompress(self, comp: memoryview, dst: memoryview, *,
                    checksummed: bool = False) -> None:
        """Decompress the single zstd frame ``comp`` into all of ``dst``, exactly.
        ``checksummed``: the frame must carry a content checksum (libzstd verifies
        it at the end of the frame; a mismatch is ``"checksum"``)."""
        expected = dst.nbytes
        try:
            params = zstandard.get_frame_parameters(comp)
        except zstandard.ZstdError as e:
            raise CorruptChunkError("codec", f"bad zstd frame header: {e}") from None
        declared = params.content_size
        if declared != expected:
            raise CorruptChunkError(
                "codec", f"zstd frame declares {declared} bytes, need {expected}")
        if checksummed and not params.has_checksum:
            raise CorruptChunkError("codec", "zstd frame without its content checksum")
        got = 0
        try:
            with self._dctx.stream_reader(comp, read_across_frames=False) as reader:
                while got < expected:
                    k = reader.readinto(dst[got:])
                    if not k:
                        break
                    got += k
                extra = reader.read(1)
        except zstandard.ZstdError as e:
            reason = "checksum" if "checksum" in str(e).lower() else "codec"
            raise CorruptChunkError(reason, f"zstd: {e}") from None
        if got != expected or extra:
            raise CorruptChunkError(
                "codec", f"zstd frame decoded to the wrong size ({got}, need {expected})")
