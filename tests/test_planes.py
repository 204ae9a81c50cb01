"""The C extension behind the codec: CRC-32C and the byte-plane split/merge, against
plain-Python and numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from shmtier.shared import _planes
from shmtier.shared._planes import crc32c, crc32c_table, merge, split


def crc32c_reference(data: bytes, value: int = 0) -> int:
    """Bit-at-a-time CRC-32C (reflected 0x82F63B78, init and final xor 0xFFFFFFFF)."""
    c = value ^ 0xFFFFFFFF
    for byte in data:
        c ^= byte
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF


def test_crc32c_check_value_and_implementation():
    assert crc32c(b"123456789") == crc32c_table(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert _planes.CRC32C_IMPL in ("sse4.2", "table")


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099])
def test_crc32c_matches_the_reference_at_every_length_and_alignment(n):
    rng = np.random.default_rng(n)
    buf = rng.integers(0, 256, n + 8, dtype=np.uint8).tobytes()
    for offset in (0, 1, 3, 7):
        data = buf[offset:offset + n]
        expected = crc32c_reference(data)
        assert crc32c(data) == crc32c_table(data) == expected
        assert crc32c(memoryview(buf)[offset:offset + n]) == expected
        # chained like zlib.crc32
        cut = n // 3
        assert crc32c(data[cut:], crc32c(data[:cut])) == expected
        assert crc32c_table(data[cut:], crc32c_table(data[:cut])) == expected


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
