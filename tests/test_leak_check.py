"""Issue 28: the suite's shared-memory leak check (``conftest.no_shm_leak``) judges this
session's entries only.

Another suite on the same host (its own ``engine_id`` prefix) may leave a segment whose
holder died while a test of this one runs: that is not this test's leak. A segment of
this session's prefix whose holder died, and one this process holds under any name,
still are. Real segments, left by real processes that died; every entry made here is
removed by the test itself.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid

import conftest
from conftest import SESSION_PREFIX, _leaks
from test_pool import _unlink_ours

from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.ring import RingSet, ring_area_nbytes
from shmtier.shared.segment import open_segment, segment_name

GEOMETRY = ArenaGeometry(num_chunks=4, row_stride=8192, page_size_per_worker=8192, world_size=1)
RINGS = ring_area_nbytes(1, 4, 4096)

# The scheduler of an engine that dies without closing its segment (no guardian):
# the segment and its ring semaphores stay, their holder dead.
_DIE_HOLDING = f"""
import os, sys
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.ring import RingSet
from shmtier.shared.segment import open_segment
s = open_segment(sys.argv[1], ArenaGeometry(4, 8192, 8192, 1), "fp", owner=True,
                 rings_len={RINGS})
RingSet.create(s.name, s.rings, 1, 4, 4096)
os._exit(0)
"""


def _entries(engine_id: str) -> set[str]:
    base = segment_name(engine_id).lstrip("/")
    return {e for e in os.listdir("/dev/shm") if e == base or e.startswith(f"sem.{base}.")}


def _left_by_a_dead_holder(engine_id: str) -> set[str]:
    subprocess.run([sys.executable, "-c", _DIE_HOLDING, engine_id], check=True, timeout=60)
    made = _entries(engine_id)
    assert len(made) == 5, made  # the segment and its 4 ring semaphores
    return made


def test_the_engine_id_fixture_carries_the_session_prefix(engine_id):
    assert engine_id.startswith(conftest.SESSION_PREFIX)  # the module the check runs in
    assert SESSION_PREFIX.startswith("test-") and len(SESSION_PREFIX) == len("test-") + 9


def test_another_suites_entries_whose_holder_died_are_not_this_tests():
    other = f"test-{uuid.uuid4().hex[:8]}-{uuid.uuid4().hex[:12]}-owner"  # another session's
    assert not other.startswith(SESSION_PREFIX)
    try:
        made = _left_by_a_dead_holder(other)
        assert _leaks(made) == set()
    finally:
        _unlink_ours(other)
    assert _entries(other) == set()


def test_this_sessions_entries_whose_holder_died_are_leaks(engine_id):
    try:
        made = _left_by_a_dead_holder(engine_id)
        assert _leaks(made) == made
    finally:
        _unlink_ours(engine_id)


def test_entries_this_process_holds_are_leaks_whatever_their_name():
    name = f"not-a-session-name-{uuid.uuid4().hex[:12]}"
    seg = rings = None
    try:
        seg = open_segment(name, GEOMETRY, "fp", owner=True, rings_len=RINGS)
        rings = RingSet.create(seg.name, seg.rings, 1, 4, 4096)
        made = _entries(name)
        assert len(made) == 5 and _leaks(made) == made
    finally:
        if rings is not None:
            rings.close()
        if seg is not None:
            seg.close()
        with contextlib.suppress(Exception):
            _unlink_ours(name)
    assert _entries(name) == set()


def test_a_node_pool_is_a_leak_while_this_process_is_in_it_or_no_live_engine_is():
    from shmtier.tiers.node.layout import shm_name
    from shmtier.tiers.node.pool import NodePool

    ours, other = f"{SESSION_PREFIX}{uuid.uuid4().hex[:8]}", f"x-{uuid.uuid4().hex[:8]}"
    entries = {shm_name(name).lstrip("/") for name in (ours, other)}
    attach = ("from shmtier.tiers.node.pool import NodePool\n"
              "import os, sys\n"
              "for name in sys.argv[1:]:\n"
              "    NodePool.attach(name, row_bytes=4096, size_bytes=8192, fingerprint='fp',"
              " engine_id='e')\n"
              "os._exit(0)\n")
    try:
        pools = [NodePool.attach(name, row_bytes=4096, size_bytes=8192, fingerprint="fp",
                                 engine_id="e") for name in (ours, other)]
        assert _leaks(entries) == entries  # this process is an engine in both
        for pool in pools:
            pool.detach()
        assert not any(os.path.exists("/dev/shm/" + e) for e in entries)
        # an engine that died in them: only this session's pool is its leak
        subprocess.run([sys.executable, "-c", attach, ours, other], check=True, timeout=60)
        assert _leaks(entries) == {shm_name(ours).lstrip("/")}
    finally:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("/dev/shm/" + entry)
