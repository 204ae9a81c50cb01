"""The fs read path's raw frames read straight into the destination row (one preadv of
header + payload, verified in the row: ``ChunkDecoder.decode_raw_in_place``): byte-exact,
every corruption still CORRUPT and removed, MAC'd frames checked, and a raw-sized frame
whose header names another codec read again and decoded as before."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shmtier.shared.codec import (ChunkDecoder, ChunkEncoder, CompressionConfig,
                                  CorruptChunkError, frame_header_size)
from shmtier.shared.jobs import Outcome
from shmtier.tiers.fs.backend import FsBackend

CHUNK = 64 << 10
MAC = b"k" * 32


def _arena(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    f = rng.standard_normal((n, CHUNK // 2), dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype("<u2").view(np.uint8).reshape(n, CHUNK)


def _keys(n: int) -> list[bytes]:
    return [bytes([i]) * 32 + b"\0\0\0\0" for i in range(n)]


@pytest.mark.parametrize("mac", [None, MAC])
def test_raw_frames_load_byte_exact_and_corrupt_ones_are_refused(tmp_path, mac):
    n = 6
    src, keys = _arena(n), _keys(n)
    b = FsBackend(str(tmp_path), "raw-in-place", codec_config=CompressionConfig("none"),
                  min_free_bytes=0, mac_key=mac)
    assert b.store(keys, range(n), src, CHUNK).outcomes == [Outcome.OK] * n
    hs = frame_header_size(len(keys[0]), mac=mac is not None)
    assert all(os.path.getsize(b.path_for(k)) == hs + CHUNK for k in keys)  # raw-sized
    # corrupt: a payload bit (checksum), a header bit (checksum), another key's frame
    # under this key's name (key), and for a MAC'd frame a bit of the tag (mac)
    def flip(path, at):
        with open(path, "r+b") as f:
            f.seek(at)
            x = f.read(1)
            f.seek(at)
            f.write(bytes([x[0] ^ 1]))
    flip(b.path_for(keys[1]), hs + CHUNK // 2)
    flip(b.path_for(keys[2]), 17)
    os.replace(b.path_for(keys[0]), b.path_for(keys[3]))
    if mac:
        flip(b.path_for(keys[4]), hs - 3)
    dst = np.zeros_like(src)
    r = b.load(keys, range(n), dst, CHUNK)
    want = [Outcome.MISS, Outcome.CORRUPT, Outcome.CORRUPT, Outcome.CORRUPT,
            Outcome.CORRUPT if mac else Outcome.OK, Outcome.OK]
    assert r.outcomes == want
    assert r.details[1:4] == ["checksum", "checksum", "key"]
    if mac:
        assert r.details[4] == "mac"
    for i, o in enumerate(want):
        if o is Outcome.OK:
            assert np.array_equal(dst[i], src[i])
        elif o is Outcome.CORRUPT:
            assert not os.path.exists(b.path_for(keys[i]))  # removed
    assert b.counters.corrupt_files_detected == sum(o is Outcome.CORRUPT for o in want)
    b.close()


def test_decode_raw_in_place_leaves_other_codecs_to_decode_into():
    enc = ChunkEncoder(CompressionConfig("auto"))
    src = _arena(1)[0]
    key = _keys(1)[0]
    parts, _ = enc.encode(src.data, key, 2)
    frame = b"".join(bytes(p) for p in parts)
    hs = frame_header_size(len(key))
    out = np.zeros(CHUNK, np.uint8)
    dec = ChunkDecoder()
    assert dec.decode_raw_in_place(memoryview(frame)[:hs], key, out.data, len(frame)) is None
    with pytest.raises(CorruptChunkError) as e:  # the checks before the codec still apply
        dec.decode_raw_in_place(memoryview(frame)[:hs], key, out.data, len(frame) + 1)
    assert e.value.reason == "length"


def test_a_raw_sized_frame_of_another_codec_is_read_again_and_decoded(tmp_path, monkeypatch):
    n = 3
    src, keys = _arena(n), _keys(n)
    b = FsBackend(str(tmp_path), "raw-in-place", codec_config=CompressionConfig("none"),
                  min_free_bytes=0)
    b.store(keys, range(n), src, CHUNK)
    monkeypatch.setattr(ChunkDecoder, "decode_raw_in_place", lambda *a: None)
    dst = np.zeros_like(src)
    assert b.load(keys, range(n), dst, CHUNK).outcomes == [Outcome.OK] * n
    assert np.array_equal(dst, src)
    b.close()
