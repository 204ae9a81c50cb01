"""Chunk frame codec (shmtier.shared.codec): exact round trips, format, and that
every kind of corruption is detected with the right reason and never served.

All data is real: random-normal float32 turned into bf16 (top 16 bits) or fp16,
float32, int8, zeros and incompressible bytes generated with numpy.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtier.shared._planes import crc32c
from shmtier.shared.codec import (
    COMPRESSION_KEY,
    FLAG_MAC,
    FRAME_MAGIC,
    FRAME_VERSION,
    MAC_TAG_BYTES,
    ChunkDecoder,
    ChunkEncoder,
    CompressionConfig,
    CorruptChunkError,
    DecodeStats,
    EncodeStats,
    frame_header_size,
    mac_key_id,
    parse_frame_header,
)

KEY = bytes(range(32)) + b"\x00\x00\x00\x07"  # a 32-byte block hash + group index
MODES = ("auto", "zstd", "none")
KIB = 1024
MIB = 1 << 20

# The documented header layout (module docstring), re-stated independently here.
HEAD = struct.Struct("<4sBBBBHHIQQI")
FIELDS = ("magic", "version", "codec_id", "element_size", "flags", "key_len", "reserved",
          "checksum", "raw_len", "stored_len", "payload_crc")


# ---------------------------------------------------------------- real data


def bf16_normal(nbytes: int, seed: int = 0) -> bytes:
    """Random-normal float32 -> bf16 by keeping the top 16 bits."""
    n = (nbytes + 1) // 2
    f = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype("<u2").tobytes()[:nbytes]


def fp16_normal(nbytes: int, seed: int = 0) -> bytes:
    n = (nbytes + 1) // 2
    return np.random.default_rng(seed).standard_normal(n).astype("<f2").tobytes()[:nbytes]


def f32_normal(nbytes: int, seed: int = 0) -> bytes:
    n = (nbytes + 3) // 4
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32).tobytes()[:nbytes]


def int8_normal(nbytes: int, seed: int = 0) -> bytes:
    x = np.random.default_rng(seed).standard_normal(nbytes) * 20
    return np.clip(np.round(x), -128, 127).astype(np.int8).tobytes()


def zeros(nbytes: int, seed: int = 0) -> bytes:
    return bytes(nbytes)


def random_bytes(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(nbytes)


DATASETS = {  # name -> (generator, element size)
    "bf16": (bf16_normal, 2),
    "fp16": (fp16_normal, 2),
    "float32": (f32_normal, 4),
    "int8": (int8_normal, 1),
    "zeros": (zeros, 2),
    "random": (random_bytes, 2),
}
SIZES = (0, 1, 3, 1001, 4097, 256 * KIB, 300 * KIB + 6, 2 * MIB)


# ---------------------------------------------------------------- helpers


def encode(raw: bytes, mode: str = "auto", key: bytes = KEY, element_size: int = 2,
           encoder: ChunkEncoder | None = None) -> tuple[bytes, EncodeStats]:
    enc = encoder or ChunkEncoder(CompressionConfig(mode=mode))
    parts, stats = enc.encode(memoryview(raw), key, element_size)
    frame = b"".join(bytes(p) for p in parts)
    assert len(parts[0]) == frame_header_size(len(key), mac=enc.mac)
    assert len(frame) == stats.stored_bytes
    return frame, stats


def decode(frame: bytes | bytearray, key: bytes = KEY, nbytes: int | None = None,
           decoder: ChunkDecoder | None = None) -> bytes:
    if nbytes is None:
        nbytes = parse_frame_header(memoryview(frame)).raw_len
    out = bytearray(nbytes)
    (decoder or ChunkDecoder()).decode_into(memoryview(frame), key, memoryview(out))
    return bytes(out)


def header_fields(frame: bytes) -> dict:
    return dict(zip(FIELDS, HEAD.unpack_from(frame, 0)))


def forge(frame: bytes, **changes) -> bytes:
    """Rewrite header fields and recompute the header CRC: a well-formed header that
    says something else (what a buggy or future writer would produce)."""
    fields = header_fields(frame)
    key_len = fields["key_len"]
    key = changes.pop("key", frame[40:40 + key_len])
    fields.update(changes)
    fields["key_len"] = len(key)
    head = HEAD.pack(*(fields[f] for f in FIELDS))
    hcrc = struct.pack("<I", crc32c(key, crc32c(head)))
    return head + hcrc + key + frame[40 + key_len:]


def flip(frame: bytes, pos: int, bit: int = 0) -> bytes:
    b = bytearray(frame)
    b[pos] ^= 1 << bit
    return bytes(b)


def error_of(frame, key=KEY, nbytes=None, out=None) -> CorruptChunkError:
    """The error decoding ``frame`` raises (the test fails if it decodes)."""
    if out is None:
        n = nbytes if nbytes is not None else header_fields(frame)["raw_len"] \
            if len(frame) >= 40 else 0
        out = bytearray(n)
    with pytest.raises(CorruptChunkError) as ei:
        ChunkDecoder().decode_into(memoryview(frame), key, memoryview(out))
    return ei.value


def reason_of(frame, key=KEY, nbytes=None, out=None) -> str:
    return error_of(frame, key, nbytes, out).reason


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_round_trip_is_byte_exact(dataset, size, mode):
    gen, element_size = DATASETS[dataset]
    raw = gen(size, seed=size)
    frame, stats = encode(raw, mode, element_size=element_size)
    assert decode(frame) == raw
    h = parse_frame_header(memoryview(frame))
    assert (h.magic, h.version, h.key, h.element_size) == (FRAME_MAGIC, FRAME_VERSION, KEY,
                                                            element_size)
    assert h.raw_len == size == stats.raw_bytes
    assert h.frame_size == len(frame) == stats.stored_bytes
    if h.codec == "split_zstd":
        lo_plane = (np.frombuffer(raw, dtype="<u2") & 0xFF).astype(np.uint8).tobytes()
        comp = frame[h.header_size:h.frame_size - size // 2]
        assert h.checksum == crc32c(lo_plane) and h.payload_crc == crc32c(comp)
    else:
        assert h.checksum == crc32c(raw)
    assert stats.codec == h.codec and stats.seconds >= 0
    if mode == "none" or size == 0:
        assert h.codec == "raw"
    if h.codec == "raw":
        assert h.stored_len == size
    elif element_size == 2 and size % 2 == 0:
        assert h.codec == "split_zstd"
    else:
        assert h.codec == "zstd"


@pytest.mark.parametrize("mode", ("auto", "zstd"))
def test_codec_choice_by_data(mode):
    cases = [  # (data, element size, expected codec at 256 KiB)
        (bf16_normal, 2, "split_zstd"),
        (fp16_normal, 2, "split_zstd"),
        (zeros, 2, "split_zstd"),
        (int8_normal, 1, "zstd"),
        (f32_normal, 4, "zstd"),  # ratio ~1.08: above the default 5% threshold
        (random_bytes, 2, "raw"),
        (random_bytes, 1, "raw"),
    ]
    for gen, es, expected in cases:
        raw = gen(256 * KIB, seed=3)
        frame, stats = encode(raw, mode, element_size=es)
        assert stats.codec == expected, (gen.__name__, es, stats)
        assert decode(frame) == raw


def test_incompressible_falls_back_to_raw_with_no_copy():
    raw = random_bytes(MIB, seed=11)
    mv = memoryview(raw)
    parts, stats = ChunkEncoder(CompressionConfig()).encode(mv, KEY, 2)
    assert stats.codec == "raw"
    assert len(parts) == 2 and parts[1].obj is raw  # the payload is a view of the input
    assert stats.stored_bytes == len(raw) + frame_header_size(len(KEY))


def test_min_gain_threshold_decides_raw_fallback():
    raw = f32_normal(256 * KIB, seed=5)  # zstd saves ~7.6% on float32 normal
    _, s = encode(raw, element_size=4)
    assert s.codec == "zstd"
    enc = ChunkEncoder(CompressionConfig(min_gain=0.2))
    _, s = encode(raw, element_size=4, encoder=enc)
    assert s.codec == "raw"
    # bf16 saves ~33%: kept at min_gain 0.3, stored raw at 0.4
    raw = bf16_normal(256 * KIB, seed=5)
    keep = ChunkEncoder(CompressionConfig(min_gain=0.3))
    assert encode(raw, encoder=keep)[1].codec == "split_zstd"
    assert encode(raw, encoder=ChunkEncoder(CompressionConfig(min_gain=0.4)))[1].codec == "raw"


@pytest.mark.parametrize("size", (MIB, 2 * MIB))
def test_bf16_random_normal_ratio_at_least_1_4_in_auto_mode(size):
    raw = bf16_normal(size, seed=size)
    frame, stats = encode(raw, "auto")
    ratio = stats.raw_bytes / stats.stored_bytes  # whole frame, header included
    assert stats.codec == "split_zstd"
    assert ratio >= 1.4, ratio
    assert decode(frame) == raw


def test_zstd_mode_level_is_used():
    raw = bf16_normal(256 * KIB, seed=9)
    s1 = encode(raw, encoder=ChunkEncoder(CompressionConfig(mode="zstd", level=1)))[1]
    s19 = encode(raw, encoder=ChunkEncoder(CompressionConfig(mode="zstd", level=19)))[1]
    assert s19.stored_bytes < s1.stored_bytes


def test_parts_write_with_os_writev_and_read_back():
    raw = bf16_normal(2 * MIB, seed=21)
    enc = ChunkEncoder(CompressionConfig())
    parts, stats = enc.encode(memoryview(raw), KEY, 2)
    assert len(parts) == 3  # header, zstd high plane, raw low plane
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "chunk")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            assert os.writev(fd, parts) == stats.stored_bytes
        finally:
            os.close(fd)
        with open(path, "rb") as f:
            frame = f.read()
    assert decode(frame) == raw


def test_encoder_and_decoder_are_reusable_across_sizes():
    enc, dec = ChunkEncoder(CompressionConfig()), ChunkDecoder()
    for i, size in enumerate((4 * KIB, 2 * MIB, 6, 256 * KIB, 2 * MIB, 0, 130)):
        raw = bf16_normal(size, seed=100 + i)
        frame, _ = encode(raw, encoder=enc)  # parts consumed before the next encode
        assert decode(frame, decoder=dec) == raw


def test_decode_into_typed_and_numpy_destinations():
    raw = bf16_normal(64 * KIB, seed=4)
    frame, _ = encode(raw)
    dec = ChunkDecoder()
    out16 = np.zeros(len(raw) // 2, dtype=np.uint16)
    dec.decode_into(memoryview(frame), KEY, memoryview(out16))  # format 'H' view
    assert out16.tobytes() == raw
    row = np.zeros((4, len(raw)), dtype=np.uint8)  # a slice of an arena-like 2-D array
    st_ = dec.decode_into(memoryview(frame), KEY, row[2])
    assert row[2].tobytes() == raw and not row[1].any() and not row[3].any()
    assert isinstance(st_, DecodeStats) and st_.raw_bytes == len(raw)
    assert st_.stored_bytes == len(frame)
    with pytest.raises(ValueError):
        dec.decode_into(memoryview(frame), KEY, memoryview(bytes(len(raw))))  # read-only


def test_encode_rejects_bad_arguments():
    enc = ChunkEncoder(CompressionConfig())
    with pytest.raises(ValueError):
        enc.encode(memoryview(b"abcd"), KEY, 0)
    with pytest.raises(ValueError):
        enc.encode(memoryview(b"abcd"), KEY, 256)
    with pytest.raises(ValueError):
        enc.encode(memoryview(b"abcd"), b"k" * 70000, 2)
    with pytest.raises(ValueError):
        frame_header_size(-1)


# ---------------------------------------------------------------- the format


def test_header_layout_matches_documentation():
    raw = bf16_normal(256 * KIB, seed=1)
    frame, stats = encode(raw)
    f = header_fields(frame)
    assert f["magic"] == FRAME_MAGIC == b"SMTK" and f["version"] == FRAME_VERSION == 2
    assert f["codec_id"] == 2 and f["element_size"] == 2 and f["flags"] == 0
    assert f["key_len"] == len(KEY) and f["reserved"] == 0
    assert f["raw_len"] == len(raw)
    assert f["stored_len"] == len(frame) - 40 - len(KEY)
    (hcrc,) = struct.unpack_from("<I", frame, 36)
    assert hcrc == crc32c(frame[40:40 + len(KEY)], crc32c(frame[:36]))
    assert frame[40:40 + len(KEY)] == KEY
    # split_zstd payload: zstd frame of the high plane, then the low plane raw
    payload = frame[40 + len(KEY):]
    half = len(raw) // 2
    u16 = np.frombuffer(raw, dtype="<u2")
    lo_plane = (u16 & 0xFF).astype(np.uint8).tobytes()
    assert payload[-half:] == lo_plane and f["checksum"] == crc32c(lo_plane)
    assert payload[:4] == b"\x28\xb5\x2f\xfd"  # zstd frame magic
    params = zstandard.get_frame_parameters(payload[:-half])
    assert params.has_checksum and params.content_size == half  # covers the high plane
    assert f["payload_crc"] == crc32c(payload[:-half])
    assert frame_header_size(len(KEY)) == 40 + len(KEY)
    assert frame_header_size(0) == 40


def test_parse_frame_header_on_header_prefix_only():
    raw = bf16_normal(256 * KIB, seed=2)
    frame, _ = encode(raw)
    hs = frame_header_size(len(KEY))
    h = parse_frame_header(memoryview(frame)[:hs])
    assert h.header_size == hs and h.frame_size == len(frame)
    with pytest.raises(CorruptChunkError) as ei:
        parse_frame_header(memoryview(frame)[:hs - 1])
    assert ei.value.reason == "length"


# ---------------------------------------------------------------- corruption


@pytest.fixture(scope="module")
def frames():
    """One frame per codec, with their raw bytes."""
    out = {}
    for name, gen, es, mode in (("split_zstd", bf16_normal, 2, "auto"),
                                ("zstd", int8_normal, 1, "auto"),
                                ("raw", bf16_normal, 2, "none")):
        raw = gen(256 * KIB, seed=7)
        frame, stats = encode(raw, mode, element_size=es)
        assert stats.codec == name
        out[name] = (frame, raw)
    return out


@pytest.mark.parametrize("codec", ("split_zstd", "zstd", "raw"))
def test_every_header_bit_flip_is_detected(frames, codec):
    frame, raw = frames[codec]
    hs = frame_header_size(len(KEY))
    dec = ChunkDecoder()
    for pos in range(hs):
        for bit in range(8):
            bad = flip(frame, pos, bit)
            out = bytearray(b"\xaa" * len(raw))
            with pytest.raises(CorruptChunkError) as ei:
                dec.decode_into(memoryview(bad), KEY, memoryview(out))
            expected = "magic" if pos < 4 else "version" if pos == 4 else "checksum"
            assert ei.value.reason == expected, (pos, bit, ei.value)
            assert out == b"\xaa" * len(raw)  # nothing written


def _payload_positions(n: int, count: int = 200, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    picks = set(range(min(n, 64))) | set(range(max(0, n - 64), n))
    picks |= set(rng.integers(0, n, size=count).tolist())
    return sorted(picks)


def assert_flips_are_checksum_errors(frame, nbytes, start, positions, fill=None):
    """A one-bit flip at each of ``positions`` (offsets from ``start``; bit i % 8 at the
    i-th) fails the decode as "checksum"; with ``fill`` (a byte), before anything was
    written to the destination (pre-filled with it)."""
    dec = ChunkDecoder()
    for i, pos in enumerate(positions):
        bad = flip(frame, start + pos, i % 8)
        out = bytearray((fill or b"\x00") * nbytes)
        with pytest.raises(CorruptChunkError) as ei:
            dec.decode_into(memoryview(bad), KEY, memoryview(out))
        assert ei.value.reason == "checksum"
        if fill is not None:
            assert out == fill * nbytes


def test_flips_in_high_plane_are_detected_before_writing(frames):
    frame, raw = frames["split_zstd"]
    clen = header_fields(frame)["stored_len"] - len(raw) // 2
    assert_flips_are_checksum_errors(frame, len(raw), frame_header_size(len(KEY)),
                                     _payload_positions(clen), fill=b"\x55")


def test_high_plane_content_checksum_catches_a_decode_that_differs(frames):
    """A compressed high plane that passes the payload CRC but decodes to other bytes
    (what a decoder fault would look like, forged here as a frame that re-compresses a
    changed plane under a correct CRC) is refused by the zstd content checksum."""
    frame, raw = frames["split_zstd"]
    hs = frame_header_size(len(KEY))
    half = len(raw) // 2
    comp = bytearray(frame[hs:len(frame) - half])
    # the 4 bytes before the end of the zstd frame are its content checksum
    comp[-1] ^= 0x10
    forged = forge(frame[:hs] + bytes(comp) + frame[-half:], payload_crc=crc32c(comp))
    out = bytearray(b"\x55" * len(raw))
    e = error_of(forged, out=out)
    assert e.reason == "checksum" and "checksum" in str(e)
    assert out == b"\x55" * len(raw)


def test_high_plane_frame_without_content_checksum_is_refused(frames):
    """A split frame whose zstd frame carries no content checksum (an older or foreign
    writer) would leave the high plane unchecked: refused as "codec", before writing."""
    frame, raw = frames["split_zstd"]
    hs = frame_header_size(len(KEY))
    half = len(raw) // 2
    u16 = np.frombuffer(raw, dtype="<u2")
    hi = (u16 >> 8).astype(np.uint8).tobytes()
    bare = zstandard.ZstdCompressor(write_checksum=False).compress(hi)
    payload = frame[hs:]
    forged = forge(frame[:hs] + bare + payload[-half:], stored_len=len(bare) + half,
                   payload_crc=crc32c(bare))
    out = bytearray(b"\x66" * len(raw))
    e = error_of(forged, out=out)
    assert e.reason == "codec" and "checksum" in str(e)
    assert out == b"\x66" * len(raw)


def test_flips_in_low_plane_are_detected(frames):
    frame, raw = frames["split_zstd"]
    half = len(raw) // 2
    assert_flips_are_checksum_errors(frame, len(raw), len(frame) - half,
                                     _payload_positions(half, seed=1))


@pytest.mark.parametrize("codec", ("zstd", "raw"))
def test_payload_flips_are_detected_before_writing(frames, codec):
    frame, raw = frames[codec]
    hs = frame_header_size(len(KEY))
    assert_flips_are_checksum_errors(frame, len(raw), hs,
                                     _payload_positions(len(frame) - hs, seed=2), fill=b"\x33")


@pytest.mark.parametrize("codec", ("split_zstd", "zstd", "raw"))
def test_truncated_or_overlong_frame_is_length(frames, codec):
    frame, raw = frames[codec]
    hs = frame_header_size(len(KEY))
    for cut in (0, 1, 3, 4, 39, 40, hs - 1, hs, hs + 1, len(frame) // 2, len(frame) - 1):
        assert reason_of(frame[:cut], nbytes=len(raw)) == "length", cut
    assert reason_of(frame + b"\x00", nbytes=len(raw)) == "length"
    with pytest.raises(CorruptChunkError) as ei:
        parse_frame_header(memoryview(frame[:39]))
    assert ei.value.reason == "length"


def test_wrong_key_is_key(frames):
    frame, raw = frames["split_zstd"]
    assert reason_of(frame, key=KEY[:-1] + b"\x08") == "key"
    assert reason_of(frame, key=KEY[:-1]) == "key"
    assert reason_of(frame, key=b"") == "key"
    # an intact frame of another key (e.g. a misplaced file) is "key", not "checksum"
    other = encode(raw, key=b"other-key")[0]
    assert reason_of(other, key=KEY) == "key"
    assert decode(other, key=b"other-key") == raw


def test_wrong_version_and_flags_are_version(frames):
    frame, _ = frames["split_zstd"]
    for v in (0, 1, 3, 255):  # 1: the format before the split codec's XXH64
        assert reason_of(forge(frame, version=v)) == "version"
    for flags in (2, 4, 0x80, 0xFF, FLAG_MAC | 2):  # every bit but FLAG_MAC is unassigned
        assert reason_of(forge(frame, flags=flags)) == "version"
    assert reason_of(forge(frame, reserved=1)) == "version"
    # FLAG_MAC says a 32-byte tag follows the key: without one the frame is too short,
    # with one a reader without a key refuses it
    assert reason_of(forge(frame, flags=FLAG_MAC)) == "length"
    hs = frame_header_size(len(KEY))
    tagged = forge(frame[:hs] + bytes(MAC_TAG_BYTES) + frame[hs:], flags=FLAG_MAC)
    assert reason_of(tagged) == "mac"


def test_bad_magic_is_magic(frames):
    frame, _ = frames["raw"]
    assert reason_of(b"XXXX" + frame[4:]) == "magic"
    assert reason_of(b"\x00" * len(frame)) == "magic"
    assert reason_of(random_bytes(4096, seed=1), nbytes=10) == "magic"


@pytest.mark.parametrize("codec", ("split_zstd", "zstd", "raw"))
def test_wrong_destination_length_is_length_and_untouched(frames, codec):
    frame, raw = frames[codec]
    for n in (0, len(raw) - 1, len(raw) + 1, 2 * len(raw)):
        out = bytearray(b"\x77" * n)
        assert reason_of(frame, out=out) == "length"
        assert out == b"\x77" * n


def test_inconsistent_codec_fields_are_detected(frames):
    split, raw = frames["split_zstd"]
    zframe, _ = frames["zstd"]
    rframe, _ = frames["raw"]
    assert reason_of(forge(split, codec_id=3)) == "codec"
    assert reason_of(forge(split, codec_id=255)) == "codec"
    assert reason_of(forge(split, element_size=4)) == "codec"
    assert reason_of(forge(split, element_size=0)) == "codec"
    assert reason_of(forge(rframe, stored_len=len(raw) - 1)) == "length"
    # the header says zstd but the payload is a raw chunk (with a valid payload CRC):
    # zstd refuses it
    payload = rframe[frame_header_size(len(KEY)):]
    assert reason_of(forge(rframe, codec_id=1, payload_crc=crc32c(payload))) == "codec"
    # a zstd payload that declares another size than the header's raw length
    assert reason_of(forge(zframe, raw_len=len(raw) - 1), nbytes=len(raw) - 1) == "codec"


def test_header_checksum_that_disagrees_with_the_payload_is_refused(frames):
    """A well-formed frame whose raw checksum disagrees with its payload (for zstd:
    with what the payload decodes to, as a decoder fault would look) is refused."""
    for codec in ("split_zstd", "zstd", "raw"):
        frame, raw = frames[codec]
        bad = forge(frame, checksum=header_fields(frame)["checksum"] ^ 1)
        assert reason_of(bad) == "checksum"


def test_corrupt_chunk_error_pickles_with_reason():
    e = CorruptChunkError("key", "frame holds key 00")
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.reason, e2.detail, str(e2)) == ("key", "frame holds key 00", str(e))
    with pytest.raises(ValueError):
        CorruptChunkError("bogus")


# ---------------------------------------------------------------- authentication (MAC)

MAC_KEY = bytes(range(100, 132))  # 32 bytes
OTHER_MAC_KEY = bytes(range(200, 232))


def mac_encoder(mode: str = "auto", mac_key: bytes = MAC_KEY) -> ChunkEncoder:
    return ChunkEncoder(CompressionConfig(mode=mode), mac_key=mac_key)


def mac_error(frame, mac_key=MAC_KEY, key=KEY, out=None) -> CorruptChunkError:
    out = bytearray(header_fields(frame)["raw_len"]) if out is None else out
    with pytest.raises(CorruptChunkError) as ei:
        ChunkDecoder(mac_key=mac_key).decode_into(memoryview(frame), key, memoryview(out))
    return ei.value


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dataset, size", [("bf16", 256 * KIB), ("bf16", 4097),
                                           ("int8", 300 * KIB + 6), ("random", 1001),
                                           ("zeros", 0)])
def test_mac_round_trip_is_byte_exact(dataset, size, mode):
    gen, element_size = DATASETS[dataset]
    raw = gen(size, seed=size)
    enc = mac_encoder(mode)
    frame, stats = encode(raw, element_size=element_size, encoder=enc)
    h = parse_frame_header(memoryview(frame))
    assert header_fields(frame)["flags"] == FLAG_MAC and len(h.tag) == MAC_TAG_BYTES
    assert h.header_size == frame_header_size(len(KEY), mac=True) == 40 + len(KEY) + 32
    assert h.frame_size == len(frame) == stats.stored_bytes
    # the same chunk without a MAC: the same frame but for the flag, the header CRC and
    # the tag (frames without a key are those of before)
    plain, _ = encode(raw, mode, element_size=element_size)
    assert len(frame) == len(plain) + MAC_TAG_BYTES
    assert frame[h.header_size:] == plain[frame_header_size(len(KEY)):]
    assert decode(frame, decoder=ChunkDecoder(mac_key=MAC_KEY)) == raw


@pytest.mark.parametrize("mac_key", [None, MAC_KEY])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", (0, 1, 4097, 300 * KIB + 6))
def test_encode_raw_into_writes_the_raw_frame_encode_makes(size, mode, mac_key):
    """``encode_raw_into`` (the fs tier's O_DIRECT stores: the payload copied and
    checksummed in one pass into the write's buffer) writes, whatever the encoder's mode,
    exactly the frame a raw encoder's ``encode`` makes, MAC tag included, at the start of
    ``out`` (nothing after it touched); it decodes back; an ``out`` one byte short is a
    ValueError naming both sizes, with nothing written."""
    raw = bf16_normal(size, seed=size)
    want, _ = encode(raw, encoder=ChunkEncoder(CompressionConfig(mode="none"), mac_key=mac_key))
    enc = ChunkEncoder(CompressionConfig(mode=mode), mac_key=mac_key)
    out = bytearray(b"\xee" * (len(want) + 100))
    stats = enc.encode_raw_into(memoryview(raw), KEY, 2, memoryview(out))
    assert out[:len(want)] == want and out[len(want):] == b"\xee" * 100
    assert (stats.raw_bytes, stats.stored_bytes, stats.codec) == (size, len(want), "raw")
    assert decode(bytes(out[:len(want)]), decoder=ChunkDecoder(mac_key=mac_key)) == raw
    short = bytearray(b"\xee" * (len(want) - 1))
    with pytest.raises(ValueError, match=f"out holds {len(want) - 1} bytes; the frame needs "
                                         f"{len(want)}"):
        enc.encode_raw_into(memoryview(raw), KEY, 2, memoryview(short))
    assert short == b"\xee" * (len(want) - 1)


@pytest.mark.parametrize("mac_key", [None, MAC_KEY])
@pytest.mark.parametrize("mode", MODES)
def test_decode_copying_decodes_as_decode_into_and_refuses_the_same(mode, mac_key):
    """``decode_copying`` (the fs tier's O_DIRECT loads: a raw frame copied into the row
    while checksummed) gives the bytes ``decode_into`` gives, for every codec; the header
    checks come first (a wrong key writes nothing); a flipped payload bit of a raw frame
    is "checksum" (the row then holds unverified bytes, not to be published), and a
    forged tag "mac"."""
    raw = bf16_normal(300 * KIB + 6, seed=8)
    enc = ChunkEncoder(CompressionConfig(mode=mode), mac_key=mac_key)
    frame, _ = encode(raw, encoder=enc)
    dec = ChunkDecoder(mac_key=mac_key)
    out = bytearray(len(raw))
    stats = dec.decode_copying(memoryview(frame), KEY, memoryview(out))
    assert out == raw and stats.raw_bytes == len(raw) and stats.stored_bytes == len(frame)
    out = bytearray(b"\xaa" * len(raw))
    with pytest.raises(CorruptChunkError) as ei:
        dec.decode_copying(memoryview(frame), bytes(36), memoryview(out))
    assert ei.value.reason == "key" and out == b"\xaa" * len(raw)
    hs = frame_header_size(len(KEY), mac=bool(mac_key))
    for pos in (hs, len(frame) - 1):
        with pytest.raises(CorruptChunkError) as ei:
            dec.decode_copying(memoryview(flip(frame, pos)), KEY, memoryview(out))
        assert ei.value.reason == "checksum"
    if mac_key is not None and mode == "none":
        forged, _ = encode(bf16_normal(len(raw), seed=9),
                           encoder=ChunkEncoder(CompressionConfig(mode="none"),
                                                mac_key=OTHER_MAC_KEY))
        with pytest.raises(CorruptChunkError) as ei:
            dec.decode_copying(memoryview(forged), KEY, memoryview(out))
        assert ei.value.reason == "mac"


def test_a_forged_frame_is_served_without_a_key_and_refused_with_one(frames):
    """The issue: CRCs authenticate nothing. Anyone who can write the medium builds, with
    the encoder, a valid frame for a key with other bytes; a reader without a key serves
    it. A reader with a key refuses it ("mac") and leaves the destination untouched."""
    _, raw = frames["split_zstd"]
    other = bf16_normal(len(raw), seed=99)
    forged, _ = encode(other, "auto")  # valid CRCs, same key, no tag
    assert decode(forged) == other  # served: the attack works without a MAC
    out = bytearray(b"\xaa" * len(raw))
    e = mac_error(forged, out=out)
    assert (e.reason, e.detail) == ("mac", "frame carries no MAC tag")
    assert out == b"\xaa" * len(raw)
    # forged with a MAC under another key: "mac", nothing written
    forged_mac, _ = encode(other, encoder=mac_encoder(mac_key=OTHER_MAC_KEY))
    e = mac_error(forged_mac, out=out)
    assert e.reason == "mac" and "does not verify" in e.detail
    assert out == b"\xaa" * len(raw)
    # and the genuine frame passes
    genuine, _ = encode(raw, encoder=mac_encoder())
    assert decode(genuine, decoder=ChunkDecoder(mac_key=MAC_KEY)) == raw


@pytest.mark.parametrize("mode", MODES)
def test_a_reader_without_a_key_refuses_a_frame_with_a_tag(mode):
    raw = bf16_normal(64 * KIB, seed=5)
    frame, _ = encode(raw, encoder=mac_encoder(mode))
    e = error_of(frame)
    assert e.reason == "mac" and "no key" in e.detail


@pytest.mark.parametrize("mode", MODES)
def test_tampering_with_a_macd_frame_is_refused(mode):
    raw = bf16_normal(64 * KIB, seed=6)
    frame, _ = encode(raw, encoder=mac_encoder(mode))
    hs = frame_header_size(len(KEY), mac=True)
    for pos in range(hs - MAC_TAG_BYTES, hs):  # every bit of the tag
        for bit in range(8):
            assert mac_error(flip(frame, pos, bit)).reason == "mac"
    # the tag stripped and the flag cleared, with a valid header CRC: no tag
    stripped = forge(frame[:hs - MAC_TAG_BYTES] + frame[hs:], flags=0)
    assert mac_error(stripped).reason == "mac"
    assert decode(stripped) == raw  # (a reader without a key would serve it)
    assert mac_error(frame, mac_key=OTHER_MAC_KEY).reason == "mac"
    # a frame of another key: "key" (the tag covers the key too)
    assert mac_error(frame, key=KEY[:-1] + b"\x09").reason == "key"


def test_the_tag_covers_header_fields_no_other_check_ties_to_the_payload():
    """A forger can rewrite a header field and its header CRC, not the tag: a raw frame's
    element size is checked by nothing else."""
    raw = bf16_normal(64 * KIB, seed=8)
    frame, _ = encode(raw, encoder=mac_encoder("none"))
    assert mac_error(forge(frame, element_size=4)).reason == "mac"
    plain, _ = encode(raw, "none")
    assert decode(forge(plain, element_size=4)) == raw  # without a MAC it passes


def test_a_payload_flip_in_a_macd_frame_reads_as_checksum(frames):
    """The CRCs come first, so bit rot is still told apart from forgery."""
    _, raw = frames["raw"]
    frame, _ = encode(raw, encoder=mac_encoder("none"))
    hs = frame_header_size(len(KEY), mac=True)
    for pos in _payload_positions(len(frame) - hs, count=20, seed=4):
        assert mac_error(flip(frame, hs + pos)).reason == "checksum"


def test_mac_keys_are_checked_and_never_shown():
    for bad in (b"", b"x" * 15, b"x" * 65):
        with pytest.raises(ValueError, match=rf"a MAC key of {len(bad)} bytes; expected 16\.\.64"):
            ChunkEncoder(mac_key=bad)
        with pytest.raises(ValueError) as ei:
            ChunkDecoder(mac_key=bad)
        assert "xxxx" not in str(ei.value)
    with pytest.raises(TypeError):
        ChunkDecoder(mac_key=MAC_KEY.hex())
    for ok in (b"k" * 16, b"k" * 64, bytearray(MAC_KEY)):
        ChunkEncoder(mac_key=ok)
    kid = mac_key_id(MAC_KEY)
    assert len(kid) == 16 and kid == mac_key_id(bytes(MAC_KEY)) != mac_key_id(OTHER_MAC_KEY)
    assert kid not in MAC_KEY.hex()
    assert not ChunkDecoder().mac and ChunkDecoder(mac_key=MAC_KEY).mac


# ---------------------------------------------------------------- properties


def _chunk_data():
    """Random bytes, low-entropy bytes, and bf16 random-normal arrays of any size."""
    return st.one_of(
        st.binary(max_size=3000),
        st.lists(st.sampled_from(b"\x00\x01\x3f\x80\xbf"), max_size=3000).map(bytes),
        st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 6000)).map(
            lambda t: bf16_normal(t[1], seed=t[0])),
    )


PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(raw=_chunk_data(), mode=st.sampled_from(MODES), element_size=st.sampled_from([1, 2, 4, 8]),
       key=st.binary(max_size=80), min_gain=st.sampled_from([0.0, 0.05, 0.5]))
def test_property_round_trip(raw, mode, element_size, key, min_gain):
    enc = ChunkEncoder(CompressionConfig(mode=mode, min_gain=min_gain))
    frame, stats = encode(raw, key=key, element_size=element_size, encoder=enc)
    assert decode(frame, key=key) == raw
    assert stats.raw_bytes == len(raw)


@PROPERTY
@given(raw=_chunk_data(), mode=st.sampled_from(MODES), element_size=st.sampled_from([1, 2, 4]),
       data=st.data())
def test_property_single_byte_corruption_never_decodes(raw, mode, element_size, data):
    frame, _ = encode(raw, mode, element_size=element_size)
    pos = data.draw(st.integers(0, len(frame) - 1), label="pos")
    xor = data.draw(st.integers(1, 255), label="xor")
    bad = bytearray(frame)
    bad[pos] ^= xor
    out = bytearray(len(raw))
    with pytest.raises(CorruptChunkError) as ei:
        ChunkDecoder().decode_into(memoryview(bad), KEY, memoryview(out))
    assert ei.value.reason in CorruptChunkError.REASONS


@PROPERTY
@given(raw=_chunk_data(), mode=st.sampled_from(MODES), element_size=st.sampled_from([1, 2, 4]),
       data=st.data())
def test_property_single_byte_change_to_a_macd_frame_never_decodes(raw, mode, element_size,
                                                                   data):
    frame, _ = encode(raw, element_size=element_size, encoder=mac_encoder(mode))
    assert decode(frame, decoder=ChunkDecoder(mac_key=MAC_KEY)) == raw
    pos = data.draw(st.integers(0, len(frame) - 1), label="pos")
    bad = bytearray(frame)
    bad[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(CorruptChunkError):
        ChunkDecoder(mac_key=MAC_KEY).decode_into(memoryview(bad), KEY,
                                                  memoryview(bytearray(len(raw))))


@PROPERTY
@given(raw=_chunk_data(), mode=st.sampled_from(MODES), data=st.data())
def test_property_truncation_never_decodes(raw, mode, data):
    frame, _ = encode(raw, mode)
    cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
    assert reason_of(frame[:cut], nbytes=len(raw)) == "length"


# ---------------------------------------------------------------- configuration


def test_compression_config_parsing():
    assert CompressionConfig.from_config(None) == CompressionConfig()
    assert CompressionConfig() == CompressionConfig("auto", 1, 0.05)
    for m in MODES:
        assert CompressionConfig.from_config(m).mode == m
    c = CompressionConfig.from_config({"mode": "zstd", "level": 3, "min_gain": 0.1})
    assert c == CompressionConfig("zstd", 3, 0.1)
    assert CompressionConfig.from_config({"level": 5.0}).level == 5
    assert CompressionConfig.from_config({"min_gain": 0}).min_gain == 0.0
    assert CompressionConfig.from_config(c) is c


ACCEPTS = ("'auto', 'zstd', 'none'", "'level'", "'min_gain'")


@pytest.mark.parametrize("value", ["fast", "", "AUTO", 3, True, ["auto"]])
def test_compression_config_errors_name_key_value_and_accepted(value):
    """Not a mode nor a mapping: the error names the key, the value, the modes and the
    mapping's keys."""
    with pytest.raises(ValueError) as ei:
        CompressionConfig.from_config(value)
    msg = str(ei.value)
    assert f"{COMPRESSION_KEY} = {value!r} is invalid: expected" in msg, msg
    assert all(part in msg for part in ACCEPTS), msg


@pytest.mark.parametrize("value, key, accepted", [
    ({"mode": "gzip"}, "mode", "one of 'auto', 'zstd', 'none'"),
    ({"level": 0}, "level", "an integer in 1..22"),
    ({"level": 23}, "level", "an integer in 1..22"),
    ({"level": "1"}, "level", "an integer in 1..22"),
    ({"level": True}, "level", "an integer in 1..22"),
    ({"level": 1.5}, "level", "an integer in 1..22"),
    ({"min_gain": -0.1}, "min_gain", "a number >= 0 and < 1"),
    ({"min_gain": 1}, "min_gain", "a number >= 0 and < 1"),
    ({"min_gain": "0.1"}, "min_gain", "a number >= 0 and < 1"),
])
def test_compression_mapping_errors_name_the_inner_key_value_and_accepted(value, key, accepted):
    with pytest.raises(ValueError) as ei:
        CompressionConfig.from_config(value)
    assert str(ei.value) == f"{COMPRESSION_KEY}.{key} = {value[key]!r} is invalid: expected {accepted}"


def test_compression_mapping_with_an_unknown_key_names_it():
    with pytest.raises(ValueError) as ei:
        CompressionConfig.from_config({"mode": "auto", "levle": 1})
    msg = str(ei.value)
    assert f"{COMPRESSION_KEY} has unknown key(s) 'levle' (did you mean 'level'?)" in msg, msg
    assert "accepted keys: ['level', 'min_gain', 'mode']" in msg, msg


def test_compression_config_round_trips_as_plain_data():
    c = CompressionConfig("zstd", 3, 0.1)
    assert c.to_dict() == {"mode": "zstd", "level": 3, "min_gain": 0.1}
    assert CompressionConfig.from_dict(c.to_dict()) == c


def test_compression_config_direct_construction_validates():
    with pytest.raises(ValueError, match="'compression'"):
        CompressionConfig(mode="lz4")
    with pytest.raises(ValueError, match="'compression'"):
        CompressionConfig(level=0)
    with pytest.raises(ValueError, match="'compression'"):
        CompressionConfig(min_gain=1.0)


# ---------------------------------------------------------------- process rules


def test_codec_imports_neither_torch_nor_vllm():
    code = ("import sys, shmtier.shared.codec; "
            "bad = {'torch', 'vllm'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
