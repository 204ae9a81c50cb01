"""The C extension behind the codec: CRC-32C and the byte-plane split/merge, against
plain-Python and numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from shmtier.shared import _planes
from shmtier.shared._planes import (copy_crc32c, copy_crc32c_streams, copy_crc32c_table, crc32c,
                                   crc32c_serial, crc32c_streams, crc32c_table, merge, split)

LONG, SHORT = _planes.CRC32C_BLOCKS  # block lengths of crc32c's three-stream path


def crc32c_reference(data: bytes, value: int = 0) -> int:
    """Bit-at-a-time CRC-32C (reflected 0x82F63B78, init and final xor 0xFFFFFFFF)."""
    c = value ^ 0xFFFFFFFF
    for byte in data:
        c ^= byte
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF


_BYTE_TABLE = [crc32c_reference(bytes([i]), 0xFFFFFFFF) ^ 0xFFFFFFFF for i in range(256)]


def crc32c_reference_bytewise(data: bytes, value: int = 0) -> int:
    """crc32c_reference a byte at a time, with a table made by crc32c_reference (the
    register after one byte with nothing before): for megabyte buffers."""
    c = value ^ 0xFFFFFFFF
    table = _BYTE_TABLE
    for byte in data:
        c = (c >> 8) ^ table[(c ^ byte) & 0xFF]
    return c ^ 0xFFFFFFFF


def _around(*points: int) -> list[int]:
    return sorted({n for p in points for n in range(max(0, p - 9), p + 10)})


# Lengths where the three-stream path changes shape: the smallest buffer it takes
# (3 * SHORT), one and two short groups, one and two long groups with and without short
# groups and a tail after them (the start may lose up to 7 bytes to alignment).
THREE_STREAM_LENGTHS = _around(3 * SHORT, 6 * SHORT, 3 * LONG, 3 * LONG + 3 * SHORT,
                               5 * LONG + 1234, 6 * LONG, 6 * LONG + 3 * SHORT - 1)


def test_crc32c_check_value_and_implementation():
    assert crc32c(b"123456789") == crc32c_table(b"123456789") == 0xE3069283
    assert crc32c_serial(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c_streams(b"123456789") == 0xE3069283
    assert _planes.CRC32C_IMPL in ("vpclmulqdq", "sse4.2", "table")


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099])
def test_crc32c_matches_the_reference_at_every_length_and_alignment(n):
    rng = np.random.default_rng(n)
    buf = rng.integers(0, 256, n + 8, dtype=np.uint8).tobytes()
    for offset in (0, 1, 3, 7):
        data = buf[offset:offset + n]
        expected = crc32c_reference(data)
        assert crc32c(data) == crc32c_table(data) == crc32c_serial(data) == expected
        assert crc32c_streams(data) == expected
        assert crc32c(memoryview(buf)[offset:offset + n]) == expected
        # chained like zlib.crc32
        cut = n // 3
        assert crc32c(data[cut:], crc32c(data[:cut])) == expected
        assert crc32c_table(data[cut:], crc32c_table(data[:cut])) == expected


def test_crc32c_three_streams_match_the_reference_around_every_block_boundary():
    assert _planes.CRC32C_BLOCKS == (LONG, SHORT) and LONG % 8 == 0 and SHORT % 8 == 0
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, max(THREE_STREAM_LENGTHS) + 8, dtype=np.uint8).tobytes()
    mv = memoryview(buf)
    for offset in (0, 1, 5, 7):
        # the table over the whole buffer once, chained, giving each (ascending) length
        expected = {}
        c = 0
        last = 0
        for n in THREE_STREAM_LENGTHS:
            c = crc32c_table(mv[offset + last:offset + n], c)
            last = n
            expected[n] = c
        for n in THREE_STREAM_LENGTHS:
            data = mv[offset:offset + n]
            assert crc32c(data) == crc32c_serial(data) == crc32c_streams(data) == expected[n], \
                (offset, n)
    # the table itself against the bit-at-a-time reference at a few of those lengths
    for n in (3 * SHORT - 1, 3 * SHORT, 3 * LONG + 1):
        assert crc32c_table(mv[1:1 + n]) == crc32c_reference(buf[1:1 + n])


def test_crc32c_of_a_chunk_matches_the_pure_python_reference_and_chains():
    n = 1408 * 1024  # a 1.4 MiB chunk, as the p2p tier moves
    buf = np.random.default_rng(14).integers(0, 256, n + 3, dtype=np.uint8).tobytes()
    data = buf[3:]  # unaligned start
    expected = crc32c_reference_bytewise(data)
    assert crc32c(data) == crc32c_serial(data) == crc32c_table(data) == expected
    assert crc32c_streams(data) == expected
    assert crc32c(memoryview(buf)[3:]) == expected
    # chained over cuts that fall on, next to and away from block boundaries
    for cuts in ([1], [3 * SHORT], [3 * LONG - 1, 3 * LONG + 5], [7, 1000, 70_000, n - 3]):
        c, start = 0, 0
        for cut in cuts + [n]:
            c = crc32c(data[start:cut], c)
            start = cut
        assert c == expected, cuts
    assert crc32c(data, 0x12345678) == crc32c_table(data, 0x12345678)
    assert crc32c(data[:-1] + bytes([data[-1] ^ 1])) != expected


def test_crc32c_large_buffer_agrees_with_the_table():
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    assert crc32c(data) == crc32c_table(data)
    flipped = data.copy()
    flipped[12345] ^= 4
    assert crc32c(flipped) != crc32c(data)


@pytest.mark.parametrize("elements", [0, 1, 8191, 8192, 8193, 100_000])
def test_split_and_merge_round_trip_and_split_returns_the_low_plane_crc(elements):
    raw = np.random.default_rng(elements).integers(0, 1 << 16, elements, dtype=np.uint16)
    raw = raw.astype("<u2")
    hi = np.full(elements, 0xAA, dtype=np.uint8)
    lo = np.full(elements, 0xAA, dtype=np.uint8)
    crc = split(raw.view(np.uint8), hi, lo)
    assert np.array_equal(hi, (raw >> 8).astype(np.uint8))
    assert np.array_equal(lo, (raw & 0xFF).astype(np.uint8))
    assert crc == crc32c(lo.tobytes())
    out = bytearray(2 * elements)
    merge(hi, lo, out)
    assert bytes(out) == raw.tobytes()


def test_sizes_and_writability_are_checked_with_clear_errors():
    raw = bytes(10)
    with pytest.raises(ValueError, match="raw has 9 bytes"):
        split(raw[:9], bytearray(4), bytearray(4))
    with pytest.raises(ValueError, match="must be 5"):
        split(raw, bytearray(4), bytearray(5))
    with pytest.raises(BufferError, match="not writable"):
        split(raw, bytes(5), bytearray(5))  # hi is read-only
    with pytest.raises(ValueError, match="out 9"):
        merge(bytes(5), bytes(5), bytearray(9))
    with pytest.raises(BufferError, match="not writable"):
        merge(bytes(5), bytes(5), bytes(10))  # out is read-only
    with pytest.raises(TypeError):
        crc32c()
    with pytest.raises(TypeError):
        crc32c("text")
    with pytest.raises(TypeError, match="1 or 2 arguments"):
        crc32c_serial(b"a", 0, 0)
    with pytest.raises(BufferError):  # not contiguous: refused, not checksummed in pieces
        crc32c(memoryview(bytes(range(100)))[::2])


def _copy_check(src, dst_len_pad: int = 8, dst_offset: int = 0, value: int = 0) -> None:
    """copy_crc32c, copy_crc32c_streams and copy_crc32c_table into a guarded destination:
    the same value as crc32c, the bytes copied, nothing written outside the destination."""
    n = len(src)
    expected = crc32c(src, value)
    for fn in (copy_crc32c, copy_crc32c_streams, copy_crc32c_table):
        guard = np.full(n + dst_offset + dst_len_pad, 0x5A, dtype=np.uint8)
        dst = guard[dst_offset:dst_offset + n]
        assert fn(dst, src, value) == expected, (fn.__name__, n, dst_offset)
        assert dst.tobytes() == bytes(src), (fn.__name__, n, dst_offset)
        assert (guard[:dst_offset] == 0x5A).all() and (guard[dst_offset + n:] == 0x5A).all()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099])
def test_copy_crc32c_copies_and_matches_crc32c_at_every_length_and_alignment(n):
    buf = np.random.default_rng(100 + n).integers(0, 256, n + 8, dtype=np.uint8).tobytes()
    for src_offset in (0, 1, 3, 7):
        for dst_offset in (0, 1, 6):
            _copy_check(memoryview(buf)[src_offset:src_offset + n], dst_offset=dst_offset)
    assert copy_crc32c(bytearray(n), buf[:n]) == crc32c_reference(buf[:n])


def test_copy_crc32c_three_streams_match_around_every_block_boundary_and_chain():
    rng = np.random.default_rng(5)
    buf = rng.integers(0, 256, max(THREE_STREAM_LENGTHS) + 8, dtype=np.uint8).tobytes()
    mv = memoryview(buf)
    for n in THREE_STREAM_LENGTHS:
        for src_offset, dst_offset in ((0, 0), (1, 0), (0, 3), (5, 7)):
            _copy_check(mv[src_offset:src_offset + n], dst_offset=dst_offset)
    # continued from a previous value, like crc32c
    data = mv[3:3 + 6 * LONG + 17]
    cut = 2 * LONG + 5
    head = bytearray(cut)
    tail = bytearray(len(data) - cut)
    assert copy_crc32c(tail, data[cut:], copy_crc32c(head, data[:cut])) == crc32c(data)
    assert bytes(head + tail) == bytes(data)
    _copy_check(data, value=0x12345678)


# Lengths where the folding path (CRC32C_IMPL "vpclmulqdq": buffers of 1024 bytes and
# more) changes shape: up to 63 bytes first to align on 64, rounds of 256, then a tail.
FOLD_LENGTHS = _around(1024, 1024 + 63, 1280, 1536, 2048 + 255, 4 * 1024 + 512)


def test_crc32c_folding_path_matches_the_table_at_every_alignment():
    rng = np.random.default_rng(8)
    buf = rng.integers(0, 256, 4 * 1024 + 600, dtype=np.uint8).tobytes()
    mv = memoryview(buf)
    for n in FOLD_LENGTHS:
        for offset in range(0, 64, 5):
            data = mv[offset:offset + n]
            expected = crc32c_table(data)
            assert crc32c(data) == crc32c_streams(data) == expected, (n, offset)
            assert crc32c(data, 0xDEADBEEF) == crc32c_table(data, 0xDEADBEEF), (n, offset)


def test_copy_crc32c_folding_path_matches_at_every_destination_alignment():
    rng = np.random.default_rng(9)
    buf = rng.integers(0, 256, 4 * 1024 + 600, dtype=np.uint8).tobytes()
    mv = memoryview(buf)
    for n in FOLD_LENGTHS:
        for dst_offset in range(0, 64, 5):
            _copy_check(mv[3:3 + n], dst_offset=dst_offset)
    _copy_check(mv[:4096], value=0xDEADBEEF)


def test_copy_crc32c_of_a_chunk_into_an_arena_row_matches_the_reference():
    n = 1408 * 1024  # a 1.4 MiB chunk into a page-aligned row, as the p2p client does
    src = np.random.default_rng(15).integers(0, 256, n + 3, dtype=np.uint8)[3:]
    arena = np.zeros((2, n + 4096), dtype=np.uint8)
    row = memoryview(arena[1, :n])
    assert copy_crc32c(row, src) == crc32c_reference_bytewise(src.tobytes())
    assert np.array_equal(arena[1, :n], src) and not arena[0].any() and not arena[1, n:].any()
    flipped = src.copy()
    flipped[n // 2] ^= 1
    assert copy_crc32c(row, flipped) != crc32c(src)


def test_copy_crc32c_refuses_wrong_sizes_read_only_and_overlapping_buffers():
    with pytest.raises(ValueError, match="dst has 9 bytes, src 10"):
        copy_crc32c(bytearray(9), bytes(10))
    with pytest.raises(ValueError, match="dst has 11 bytes, src 10"):
        copy_crc32c_table(bytearray(11), bytes(10))
    with pytest.raises(ValueError, match="dst has 11 bytes, src 10"):
        copy_crc32c_streams(bytearray(11), bytes(10))
    with pytest.raises(BufferError, match="dst must be a writable contiguous buffer, got bytes"):
        copy_crc32c(bytes(10), bytes(10))
    with pytest.raises(BufferError, match="writable contiguous"):
        copy_crc32c(memoryview(bytearray(20))[::2], bytes(10))
    with pytest.raises(TypeError, match="got str"):
        copy_crc32c("0123456789", bytes(10))
    with pytest.raises(TypeError, match="2 or 3 arguments"):
        copy_crc32c(bytearray(1))
    buf = bytearray(range(100))
    with pytest.raises(ValueError, match="overlap"):
        copy_crc32c(memoryview(buf)[10:60], memoryview(buf)[:50])
    with pytest.raises(ValueError, match="overlap"):
        copy_crc32c(buf, buf)
    assert buf == bytearray(range(100))  # refused before anything was written
    copy_crc32c(memoryview(buf)[50:], memoryview(buf)[:50])  # adjacent: fine
    assert buf[50:] == buf[:50]
