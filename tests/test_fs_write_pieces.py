"""The fs tier's buffered writes go to the kernel in pieces of at most WRITE_PIECE_BYTES
(shmtier/tiers/fs/fileio.py ``writev_all``): byte-exact on real files, every ``writev``
within the bound, and a real short write (the file-size limit) continued, then reported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmtier.tiers.fs import fileio
from shmtier.tiers.fs.fileio import WRITE_PIECE_BYTES, writev_all


def frame_parts(payload: int) -> list:
    """A frame as the store path hands it over: a small header, the payload (a view of a
    larger row, as an arena row slice is), a tail."""
    rng = np.random.default_rng(payload)
    row = rng.integers(0, 256, payload + 4096, dtype=np.uint8)
    return [bytes(range(77)), memoryview(row)[:payload], b"tail!"]


@pytest.mark.parametrize("payload", [
    1000,                          # one small write
    WRITE_PIECE_BYTES - 77 - 5,    # exactly one piece with header and tail
    WRITE_PIECE_BYTES,             # just over: two pieces
    1408 * 1024,                   # the design's chunk: six pieces
    3 * WRITE_PIECE_BYTES + 12345,
])
def test_pieces_are_bounded_and_the_file_is_byte_exact(tmp_path, monkeypatch, payload):
    parts = frame_parts(payload)
    total = sum(len(memoryview(p).cast("B")) for p in parts)
    sizes = []
    real_writev = os.writev

    def recording_writev(fd, buffers):  # the real system call, its sizes noted
        sizes.append(sum(len(memoryview(b).cast("B")) for b in buffers))
        return real_writev(fd, buffers)

    monkeypatch.setattr(fileio.os, "writev", recording_writev)
    path = tmp_path / "frame"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    try:
        writev_all(fd, parts, total)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert sum(sizes) == total
    assert all(0 < s <= WRITE_PIECE_BYTES for s in sizes)
    assert len(sizes) == -(-total // WRITE_PIECE_BYTES)  # full pieces, then the rest


def test_a_short_write_is_continued_then_its_error_raised(tmp_path):
    """RLIMIT_FSIZE makes the kernel accept part of a write and refuse the rest (EFBIG):
    what was accepted stays in order, and the error reaches the caller (in a child, so the
    limit and SIGXFSZ stay out of the test process)."""
    limit = WRITE_PIECE_BYTES + 5000  # inside the second piece
    script = textwrap.dedent(f"""
        import errno, os, resource, signal, sys
        from shmtier.tiers.fs.fileio import writev_all
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        data = bytes(range(256)) * ({3 * WRITE_PIECE_BYTES} // 256)
        fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            writev_all(fd, [data[:100], memoryview(data)[100:]], len(data))
        except OSError as e:
            print(errno.errorcode[e.errno])
        else:
            print("no error")
    """)
    path = tmp_path / "capped"
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "EFBIG"
    data = bytes(range(256)) * (3 * WRITE_PIECE_BYTES // 256)
    assert path.read_bytes() == data[:limit]
