"""Issue 28, defect 7: one staleness rule for a segment that was never initialised.

A zero-length ``/dev/shm/shmtier_<id>``, one of zeros, and one whose creator wrote its
header and died before it was ready: ``shmtier ls`` calls each STALE, ``shmtier clean``
removes it, and an engine start replaces it, all from the first moment (no 30 s wait,
no 5 s of "live"). A creator still at work (holding the segment's lock before its
header is written, or alive with its header written) is live for all three and waited
for. Real segments, processes and the real CLI; everything is removed also on failure.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import pytest

from shmtier.cli import main as cli_main
from shmtier.config import KVLayout
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.segment import SegmentTimeoutError, open_segment, segment_name
from shmtier.shared.segment_tools import list_segments

GEOMETRY = ArenaGeometry(num_chunks=8, row_stride=8192, page_size_per_worker=4096, world_size=2)
FP = "model=m dtype=bf16 block=16x4"
PAGE = 8192
LAYOUT = KVLayout("m", "bfloat16", 16, PAGE, 1)
START_WITHIN_S = 5.0  # "well under" the 30 s open timeout it used to wait out
CTX = mp.get_context("spawn")

# A creator that wrote its header (state INITIALISING) and died: as ``open_segment``'s
# creator does first, by the module's own encoder, then exits before any later step.
_DIE_AFTER_HEADER = """
import os, sys
import posix_ipc
from shmtier.shared import segment as seg
from shmtier.shared.layout import HEADER_SIZE, ArenaGeometry, SegmentLayout
layout = SegmentLayout.for_geometry(ArenaGeometry(8, 8192, 4096, 2))
shm = posix_ipc.SharedMemory(sys.argv[1], posix_ipc.O_CREX, mode=0o600, size=0)
os.pwrite(shm.fd, seg._encode_header(layout, "x").ljust(HEADER_SIZE, b"\\0"), 0)
if sys.argv[2] == "sized":
    os.ftruncate(shm.fd, layout.total_len)
os._exit(0)
"""

# A creator between its create and its header: it holds the segment's lock (as
# ``open_segment``'s creator does until its header is written) and says so.
_HOLD_HEADERLESS = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
sys.stdin.read()
"""


def _path(engine_id: str) -> str:
    return "/dev/shm/" + segment_name(engine_id).lstrip("/")


def _never_initialised(engine_id: str, kind: str) -> None:
    """Leave segment ``engine_id`` never initialised, as ``kind`` says."""
    path = _path(engine_id)
    if kind in ("zero-length", "zeros"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if kind == "zeros":
                os.ftruncate(fd, 1 << 20)
        finally:
            os.close(fd)
        return
    subprocess.run([sys.executable, "-c", _DIE_AFTER_HEADER, segment_name(engine_id),
                    "sized" if kind == "creator dead, sized" else "header"],
                   check=True, timeout=60)


KINDS = ["zero-length", "zeros", "creator dead, header only", "creator dead, sized"]


@pytest.fixture
def gone_after(engine_id):
    """Removes segment ``engine_id`` after the test, whatever it left."""
    yield engine_id
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(engine_id))


def _cli(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(list(argv)) == 0
    return out.getvalue()


def _ls_alive(engine_id: str) -> bool | None:
    """What ``shmtier ls --json`` says of the segment (None: not listed)."""
    name = segment_name(engine_id)
    for row in json.loads(_cli("ls", "--json")):
        if row["name"] == name:
            return row["alive"]
    return None


@pytest.mark.parametrize("kind", KINDS)
def test_ls_and_clean_agree_it_is_stale_from_the_first_moment(gone_after, kind):
    engine_id = gone_after
    _never_initialised(engine_id, kind)
    name = segment_name(engine_id)
    assert [s.alive for s in list_segments() if s.name == name] == [False]
    assert _ls_alive(engine_id) is False
    assert "STALE" in [line.split()[1] for line in _cli("ls").splitlines()
                       if line.startswith(engine_id[:24])]
    assert f"removed {name}" in _cli("clean", engine_id).splitlines()
    assert not os.path.exists(_path(engine_id))


@pytest.mark.parametrize("kind", KINDS)
def test_an_engine_starts_at_once_on_a_never_initialised_segment(gone_after, kind):
    from shmtier.spec import TieringOffloadingSpec

    engine_id = gone_after
    _never_initialised(engine_id, kind)
    t0 = time.monotonic()
    spec = TieringOffloadingSpec({"cpu_bytes_to_use": 16 * PAGE}, LAYOUT, engine_id)
    manager = spec.get_manager()
    try:
        took = time.monotonic() - t0
        segment = manager.primary.segment
        assert segment.is_creator and segment.is_owner
        assert os.stat(_path(engine_id)).st_size == segment.layout.total_len
        assert _ls_alive(engine_id) is True
        assert took < START_WITHIN_S, took
    finally:
        manager.shutdown()
    assert not os.path.exists(_path(engine_id))


def test_a_gpu_worker_opening_first_replaces_it_at_once(gone_after):
    """vLLM opens a GPU worker's member before the scheduler: it replaces it too."""
    engine_id = gone_after
    _never_initialised(engine_id, "zero-length")
    t0 = time.monotonic()
    with open_segment(engine_id, GEOMETRY, FP, owner=False, rank=0) as s:
        assert s.is_creator and time.monotonic() - t0 < START_WITHIN_S


def test_a_creator_before_its_header_is_live_and_waited_for(gone_after):
    """A creator that holds the segment's lock and has not written its header yet is at
    work: live for ls, kept by clean, waited for by an opener; once it is gone (its
    lock with it), the segment is stale at once."""
    engine_id = gone_after
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_HEADERLESS, _path(engine_id)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        name = segment_name(engine_id)
        assert [s.alive for s in list_segments() if s.name == name] == [True]
        assert _ls_alive(engine_id) is True
        assert f"removed {name}" not in _cli("clean", engine_id)
        with pytest.raises(SegmentTimeoutError, match="held its lock"):
            open_segment(engine_id, GEOMETRY, FP, owner=False, rank=0, timeout_s=0.5)
        assert os.path.exists(_path(engine_id))
    finally:
        holder.stdin.close()
        holder.wait(20)
        holder.stdout.close()
    assert _ls_alive(engine_id) is False
    with open_segment(engine_id, GEOMETRY, FP, owner=True) as s:
        assert s.is_creator


def _slow_creator(engine_id: str, hold_s: float, started) -> None:
    """Child: create the segment as usual, but take ``hold_s`` longer to initialise it
    (its header is written, its ready mark not yet)."""
    from shmtier.shared import segment as seg

    real = seg._prefault

    def slow(*args):
        started.set()
        time.sleep(hold_s)
        real(*args)

    seg._prefault = slow
    s = open_segment(engine_id, GEOMETRY, FP, owner=False, rank=1)
    time.sleep(30)  # holds it until killed
    s.close()


def test_a_live_creator_still_initialising_is_waited_for(gone_after):
    engine_id = gone_after
    started = CTX.Event()
    creator = CTX.Process(target=_slow_creator, args=(engine_id, 2.0, started))
    creator.start()
    try:
        assert started.wait(30)
        name = segment_name(engine_id)
        assert [s.alive for s in list_segments() if s.name == name] == [True]
        assert _ls_alive(engine_id) is True
        assert f"removed {name}" not in _cli("clean", engine_id)
        got: dict = {}

        def join():
            t0 = time.monotonic()
            with open_segment(engine_id, GEOMETRY, FP, owner=False, rank=0,
                              timeout_s=30) as s:
                got["creator"], got["waited"] = s.is_creator, time.monotonic() - t0

        t = threading.Thread(target=join)
        t.start()
        t.join(40)
        assert got["creator"] is False  # it joined the creator's segment
        assert got["waited"] >= 0.5, got  # and waited for its ready mark
    finally:
        creator.kill()
        creator.join(20)
