"""The node pool's shared segment (issue 31, shmtier/tiers/node/pool.py): real /dev/shm,
real processes (tests/node_pool_proc.py), SIGKILL of writers, pinners and lock holders.

What a user depends on: bytes come back exactly; a key is stored once (EXISTS after);
one capacity bound with LRU eviction that never takes a pinned row; any number of
processes storing and loading at once with no wrong byte; a process killed anywhere
leaves nothing served that it half wrote, no pin held, and a consistent pool
(``NodePool.check``); corrupt bytes are never served; a joiner of another layout is told
which field differs; the last engine out removes the pool unless told to keep it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import SESSION_PREFIX
from node_pool_proc import key, payload

from shmtier.shared import procinfo
from shmtier.shared.jobs import Outcome
from shmtier.shared.segment import SegmentSpaceError, fingerprint_digest
from shmtier.tiers.node import mutations, tools
from shmtier.tiers.node.index import key_hash
from shmtier.tiers.node.layout import NodeLayout, encode_identity, shm_name
from shmtier.tiers.node.pool import NodePool, NodePoolError, NodePoolMismatchError

OK, MISS, EXISTS, REJECTED, CORRUPT, INVALID = (Outcome.OK, Outcome.MISS, Outcome.EXISTS,
                                                Outcome.REJECTED, Outcome.CORRUPT,
                                                Outcome.INVALID)
PROC = Path(__file__).with_name("node_pool_proc.py")
FP = "model=m dtype=bfloat16 block=16x1 bytes_per_block=8192 world=1 replicated=0"
ROW = 8192


def _path(name: str) -> str:
    return "/dev/shm/" + shm_name(name).lstrip("/")


@pytest.fixture
def pool_name():
    """A pool name of this session (the leak check knows it); whatever the test leaves
    under it is removed afterwards."""
    name = f"{SESSION_PREFIX}{uuid.uuid4().hex[:12]}"
    yield name
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(name))


@pytest.fixture
def procs():
    """Start processes of node_pool_proc.py; each is killed and reaped afterwards."""
    started = []

    def start(**args) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, str(PROC), json.dumps(args)], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(30)
        for f in (p.stdin, p.stdout):
            if f:
                f.close()


def _attach(name, rows=16, *, row_bytes=ROW, **kw) -> NodePool:
    kw.setdefault("engine_id", "parent")
    kw.setdefault("fingerprint", FP)
    return NodePool.attach(name, row_bytes=row_bytes, size_bytes=rows * ROW, **kw)


def _args(name, rows=16, **kw) -> dict:
    return dict(pool=name, row_bytes=ROW, size_bytes=rows * ROW, fp=FP, **kw)


def _store(pool, ids) -> list:
    return pool.store_many([key(i) for i in ids], [payload(i, ROW) for i in ids])


def _load(pool, ids) -> tuple[list, list]:
    dsts = [np.zeros(ROW, np.uint8) for _ in ids]
    return pool.load_many([key(i) for i in ids], dsts), dsts


def _assert_exact(pool, ids) -> None:
    out, dsts = _load(pool, ids)
    assert out == [OK] * len(ids)
    for i, dst in zip(ids, dsts):
        assert np.array_equal(dst, payload(i, ROW)), f"key {i}: wrong bytes"


def _wait_line(p: subprocess.Popen, want: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"process exited ({p.poll()}) before printing {want!r}")
        if line.startswith(want):
            return line
        if line.startswith("NOT STOPPED"):
            raise AssertionError(f"process never reached its stop point ({want})")
    raise AssertionError(f"no {want!r} within {timeout} s")


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(30)


def _result(p: subprocess.Popen, timeout: float = 240) -> dict:
    if p.stdin and p.stdin.closed:
        p.stdin = None  # closed to tell it to finish
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"process failed ({p.returncode}): {out[-2000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _lock_held(name: str) -> bool:
    fd = os.open(_path(name), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# -- single process ----------------------------------------------------------------------


def test_many_keys_round_trip_byte_exact(pool_name):
    with _attach(pool_name, rows=300) as pool:
        ids = list(range(250))
        for start in range(0, 250, 25):
            assert _store(pool, ids[start:start + 25]) == [OK] * 25
        assert all(pool.lookup(key(i)) for i in ids)
        assert not pool.lookup(key(999))
        _assert_exact(pool, ids)
        assert pool.check() == []
        stats = pool.stats()
        assert (stats["used"], stats["free"], stats["pins"]) == (250, 50, 0)
        engine, = stats["engines"]
        assert (engine["engine_id"], engine["stores"], engine["loads"]) == ("parent", 250, 250)
        assert engine["bytes_in"] == engine["bytes_out"] == 250 * ROW


def test_store_of_an_existing_key_is_exists_and_keeps_the_first_bytes(pool_name):
    with _attach(pool_name) as pool:
        assert _store(pool, [1]) == [OK]
        other = payload(2, ROW)
        assert pool.store_many([key(1), key(1)], [other, other]) == [EXISTS, EXISTS]
        _assert_exact(pool, [1])
        assert pool.stats()["used"] == 1


def test_capacity_bound_and_lru_order_loads_bump(pool_name):
    with _attach(pool_name, rows=8) as pool:
        assert _store(pool, range(8)) == [OK] * 8
        assert _load(pool, [0, 1])[0] == [OK, OK]  # 0 and 1 now the most recent
        assert _store(pool, [8, 9, 10]) == [OK] * 3
        present = [i for i in range(11) if pool.lookup(key(i))]
        assert present == [0, 1, 5, 6, 7, 8, 9, 10]  # 2, 3, 4 evicted, oldest first
        stats = pool.stats()
        assert (stats["used"], stats["evictions"]) == (8, 3)
        _assert_exact(pool, present)
        assert pool.check() == []


def test_pinned_rows_are_never_evicted_and_all_pinned_rejects(pool_name):
    with _attach(pool_name, rows=4) as pool, _attach(pool_name, rows=4) as other:
        assert _store(pool, range(4)) == [OK] * 4
        seen = {}

        def hook(point, _pool, rows):
            if point == "load.copy" and "out" not in seen:
                # every row pinned by this load: nothing may be evicted
                seen["stats"] = other.stats()
                seen["out"] = _store(other, [10, 11])
        mutations.crash_hook = hook
        try:
            out, dsts = _load(pool, range(4))
        finally:
            mutations.crash_hook = None
        assert out == [OK] * 4
        assert seen["out"] == [REJECTED, REJECTED]
        assert (seen["stats"]["pinned"], seen["stats"]["pins"]) == (4, 4)
        assert all(np.array_equal(d, payload(i, ROW)) for i, d in enumerate(dsts))
        # half of them pinned: stores evict only the others
        seen.clear()

        def hook2(point, _pool, rows):
            if point == "load.copy" and "out" not in seen:
                seen["out"] = _store(other, [20, 21, 22, 23])
        mutations.crash_hook = hook2
        try:
            assert _load(pool, [0, 1])[0] == [OK, OK]
        finally:
            mutations.crash_hook = None
        # one batch: 20 and 21 evict 2 and 3; 22 and 23 find only pinned rows or rows the
        # batch itself is writing
        assert seen["out"] == [OK, OK, REJECTED, REJECTED]
        assert [pool.lookup(key(i)) for i in (0, 1, 2, 3, 20, 21)] == [True, True, False,
                                                                      False, True, True]
        assert pool.check() == [] and pool.stats()["pins"] == 0


def test_corrupted_arena_bytes_are_never_served_and_the_key_is_dropped(pool_name):
    with _attach(pool_name, rows=4) as pool:
        assert _store(pool, [1, 2]) == [OK, OK]
        row = pool.index.find(key(1), key_hash(key(1)))
        off = row * pool.layout.row_stride + 100
        pool.v.arena[off] ^= 0x40
        details = {}
        dsts = [np.zeros(ROW, np.uint8) for _ in range(2)]
        assert pool.load_many([key(1), key(2)], dsts, details) == [CORRUPT, OK]
        assert details == {0: "checksum"}
        assert not pool.lookup(key(1)) and pool.lookup(key(2))
        assert _load(pool, [1])[0] == [MISS]
        stats = pool.stats()
        assert (stats["corrupt"], stats["used"], stats["free"], stats["dropped"]) == (1, 1, 3, 0)
        assert pool.check() == []
        assert _store(pool, [1]) == [OK]  # stored again, whole
        _assert_exact(pool, [1, 2])


def test_bad_keys_buffers_names_and_sizes_are_refused_with_what_is_wrong(pool_name):
    with _attach(pool_name, rows=4) as pool:
        details = {}
        out = pool.store_many([b"", b"x" * 101, key(1), key(2)],
                              [payload(0, ROW)] * 2 + [b"short", payload(2, ROW)], details)
        assert out == [INVALID, INVALID, INVALID, OK]
        assert "key length 0" in details[0] and "key length 101" in details[1]
        assert "src has 5 bytes, the pool's rows 8192" in details[2]
        assert pool.load_many([key(2)], [bytes(ROW)], details) == [INVALID]
        assert pool.check() == []
    with pytest.raises(ValueError, match=r"node pool name 'a/b' is invalid"):
        NodePool.attach("a/b", row_bytes=ROW, size_bytes=ROW, fingerprint=FP, engine_id="e")
    with pytest.raises(ValueError, match=r"size_bytes = 100 is invalid: expected at least one row of 8192"):
        NodePool.attach(pool_name, row_bytes=ROW, size_bytes=100, fingerprint=FP, engine_id="e")
    assert not os.path.exists(_path(pool_name))


def test_a_joiner_of_another_layout_or_size_is_told_the_pool_field_and_both_values(pool_name):
    with _attach(pool_name, rows=4):
        other_fp = FP.replace("dtype=bfloat16", "dtype=float16")
        with pytest.raises(NodePoolMismatchError) as e:
            _attach(pool_name, rows=4, fingerprint=other_fp, engine_id="joiner")
        text = str(e.value)
        assert pool_name in text and "dtype is 'bfloat16' in the pool, 'float16' for this engine" in text
        with pytest.raises(NodePoolMismatchError, match=rf"{pool_name}.*size_bytes is 32768 in "
                                                        r"the pool, 65536 for this engine"):
            _attach(pool_name, rows=8)
        with pytest.raises(NodePoolMismatchError, match=r"row_bytes is 8192 in the pool, 8000"):
            _attach(pool_name, rows=4, row_bytes=8000)
        assert len(NodePool.open(pool_name).stats()["engines"]) == 1


def test_a_worker_maps_an_existing_pool_only_and_counts_for_its_engine(pool_name):
    with pytest.raises(NodePoolError, match=rf"node pool '{pool_name}' does not exist"):
        _attach(pool_name, register=False)
    assert not os.path.exists(_path(pool_name))
    with _attach(pool_name, engine_id="eng") as engine:
        worker = _attach(pool_name, engine_id="eng", register=False)
        try:
            assert _store(worker, [1, 2]) == [OK, OK]
            engine.count_lookup(1, 3)
        finally:
            worker.close()
        entry, = engine.stats()["engines"]
        assert (entry["stores"], entry["lookups"], entry["hits"]) == (2, 3, 1)


def test_a_stale_file_under_the_pools_name_is_replaced(pool_name):
    with open(_path(pool_name), "wb") as f:
        f.write(b"not a pool")
    with _attach(pool_name) as pool:
        assert _store(pool, [1]) == [OK] and pool.check() == []


def test_a_pool_larger_than_dev_shm_is_refused_and_nothing_is_left(pool_name):
    free = shutil.disk_usage("/dev/shm").free
    with pytest.raises(SegmentSpaceError, match=rf"segment /shmtier-node_{pool_name} needs "):
        NodePool.attach(pool_name, row_bytes=ROW, size_bytes=free + (1 << 30),
                        fingerprint=FP, engine_id="e")
    assert not os.path.exists(_path(pool_name))


def test_a_pool_whose_creator_died_initialising_it_is_replaced(pool_name):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    layout = NodeLayout.for_pool(ROW, 4 * ROW)
    with open(_path(pool_name), "wb") as f:  # INITIALISING, by a creator that is gone
        f.write(encode_identity(layout, (int(dead.stdout), 1), procinfo.boot_id(),
                                fingerprint_digest(FP), FP))
    with _attach(pool_name, rows=4) as pool:
        assert _store(pool, [1]) == [OK] and pool.check() == []


# -- many processes ----------------------------------------------------------------------


def test_engines_attaching_at_once_share_one_pool(pool_name, procs):
    engines = [procs(role="hold", **_args(pool_name), engine=f"e{k}") for k in range(4)]
    for p in engines:
        _wait_line(p, "ATTACHED")
    pool = NodePool.open(pool_name)
    try:
        assert sorted(e["engine_id"] for e in pool.stats()["engines"]) == ["e0", "e1", "e2", "e3"]
        assert pool.check() == []
    finally:
        pool.close()
    for p in engines:
        p.stdin.close()
        assert _result(p) == {"detached": True}
    assert not os.path.exists(_path(pool_name))  # the last of them removed it


@pytest.mark.parametrize("n", [2, 4])
def test_processes_storing_and_loading_at_once_load_no_wrong_byte(pool_name, procs, n):
    with _attach(pool_name, rows=24) as pool:
        children = [procs(role="mixed", **_args(pool_name, rows=24), engine=f"e{k}", seed=k,
                          keys=60, batch=6, ops=250, register=k % 2 == 0)
                    for k in range(n)]
        reports = [_result(p) for p in children]
        assert sum(r["wrong"] for r in reports) == 0
        assert sum(r["errors"] + r["corrupt"] for r in reports) == 0
        assert sum(r["loaded"] for r in reports) > 0 and sum(r["stored"] for r in reports) > 0
        assert pool.check() == []
        stats = pool.stats()
        assert stats["used"] == 24 and stats["pins"] == 0 and stats["writing"] == 0
        present = [i for i in range(60) if pool.lookup(key(i))]
        assert len(present) == 24
        _assert_exact(pool, present)


def test_lookups_never_answer_wrong_for_stable_keys_while_another_process_mutates(pool_name, procs):
    stable, absent = list(range(8)), list(range(500, 508))
    with _attach(pool_name, rows=16) as pool:
        assert _store(pool, stable) == [OK] * 8
        churn = procs(role="churn", **_args(pool_name, rows=16), engine="churn", first=1000,
                      stable=stable, seconds=3)
        false_hits = present = false_misses = 0
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            for i in stable:
                present += 1
                false_misses += not pool.lookup(key(i))
            false_hits += sum(pool.lookup(key(i)) for i in absent)
        report = _result(churn)
        assert "error" not in report and report["stores"] > 50  # it evicted all along
        assert false_hits == 0
        assert false_misses <= present // 1000, (false_misses, present)
        assert pool.stats()["evictions"] >= report["stores"] - 8


# -- processes killed --------------------------------------------------------------------


def test_a_writer_killed_mid_copy_leaves_nothing_served_and_its_row_is_reclaimed(pool_name, procs):
    with _attach(pool_name, rows=4) as pool:
        writer = procs(role="stop", **_args(pool_name, rows=4), engine="w", op="store",
                       point="store.copy", stop_keys=[7])
        _wait_line(writer, "STOPPED")
        assert pool.stats()["writing"] == 1
        _kill(writer)
        assert not pool.lookup(key(7))
        assert _load(pool, [7])[0] == [MISS]
        assert pool.stats()["writing"] == 1  # not yet swept
        with _attach(pool_name, rows=4, engine_id="next"):  # an engine attaching sweeps
            stats = pool.stats()
            assert (stats["writing"], stats["free"], stats["swept"]["writes"]) == (0, 4, 1)
        assert _store(pool, [7, 1, 2, 3]) == [OK] * 4
        _assert_exact(pool, [7, 1, 2, 3])
        assert pool.check() == []


def test_a_pinner_killed_mid_load_has_its_pin_swept_and_the_row_is_evictable(pool_name, procs):
    with _attach(pool_name, rows=1) as pool:
        assert _store(pool, [1]) == [OK]
        pinner = procs(role="stop", **_args(pool_name, rows=1), engine="p", register=False,
                       op="load", point="load.copy", stop_keys=[1])
        _wait_line(pinner, "STOPPED")
        assert (pool.stats()["pinned"], pool.stats()["pins"]) == (1, 1)
        _kill(pinner)
        # the only row is pinned by a dead process: the store sweeps and evicts it
        assert _store(pool, [2]) == [OK]
        stats = pool.stats()
        assert (stats["pins"], stats["swept"]["pins"], stats["evictions"]) == (0, 1, 1)
        assert not pool.lookup(key(1))
        _assert_exact(pool, [2])
        assert pool.check() == []


# (point, what the killed child does, its keys, keys the parent stores first, of which
# corrupted)
_HOLDER_STOPS = [
    ("reserve", "store", [40], [0, 1], []),        # WRITING, not yet counted
    ("evict", "store", [40], list(range(4)), []),  # the pool full: FREE, still indexed
    ("publish", "store", [40], [0, 1], []),        # READY, not yet in the index
    ("load.pin", "load", [1], [0, 1, 2], []),      # pin entry written, count not yet
    ("unpin", "load", [1], [0, 1, 2], []),         # count down, entry not yet freed
    ("drop", "load", [1], [0, 1, 2], [1]),         # failed its CRC: DROPPED, still indexed
]


@pytest.mark.parametrize("point,op,stop_keys,first,corrupted", _HOLDER_STOPS,
                         ids=[s[0] for s in _HOLDER_STOPS])
def test_the_lock_holder_killed_mid_mutation_is_repaired_by_the_next_locker(
        pool_name, procs, point, op, stop_keys, first, corrupted):
    with _attach(pool_name, rows=4) as pool:
        assert _store(pool, first) == [OK] * len(first)
        for i in corrupted:
            pool.v.arena[pool.index.find(key(i), key_hash(key(i))) * pool.layout.row_stride] ^= 1
        holder = procs(role="stop", **_args(pool_name, rows=4), engine="h", register=False,
                       op=op, point=point, stop_keys=stop_keys)
        _wait_line(holder, "STOPPED")
        assert _lock_held(pool_name)
        _kill(holder)
        assert not _lock_held(pool_name)
        assert pool.check() == []  # the first locker repaired
        stats = pool.stats()
        assert (stats["repairs"], stats["pins"], stats["writing"]) == (1, 0, 0)
        present = [i for i in sorted(set(first + stop_keys)) if pool.lookup(key(i))]
        assert not set(corrupted) & set(present)
        _assert_exact(pool, present)
        assert stats["used"] == len(present) and stats["used"] + stats["free"] == 4
        assert _store(pool, [50, 51]) == [OK, OK]
        assert pool.check() == []


def test_processes_killed_at_random_leave_a_consistent_pool_and_no_wrong_byte(pool_name, procs):
    import random
    rng = random.Random(31)
    with _attach(pool_name, rows=12) as pool:
        for round_ in range(16):
            victim = procs(role="mixed", **_args(pool_name, rows=12), engine=f"v{round_}",
                           seed=round_, keys=40, batch=4, ops=10 ** 6, register=False)
            _wait_line(victim, "RUNNING")
            time.sleep(rng.random() * 0.2)
            _kill(victim)
            assert pool.check() == [], f"round {round_}"
            present = [i for i in range(40) if pool.lookup(key(i))]
            _assert_exact(pool, present)
        pool.sweep()
        stats = pool.stats()
        assert stats["pins"] == 0 and stats["writing"] == 0 and pool.check() == []


# -- lifetime ----------------------------------------------------------------------------


def test_the_last_engine_out_removes_the_pool(pool_name, procs):
    other = procs(role="hold", **_args(pool_name), engine="other")
    _wait_line(other, "ATTACHED")
    pool = _attach(pool_name)
    assert [e["engine_id"] for e in pool.stats()["engines"]] == ["other", "parent"]
    other.stdin.close()
    assert _result(other) == {"detached": True}
    assert os.path.exists(_path(pool_name))  # this engine is still in it
    pool.detach()
    assert not os.path.exists(_path(pool_name))


def test_keep_leaves_the_pool_for_a_restart_and_clean_removes_it_when_asked(pool_name):
    with _attach(pool_name, keep=True) as pool:
        assert _store(pool, [1]) == [OK]
    assert os.path.exists(_path(pool_name))
    status, = [s for s in tools.list_pools() if s.pool == pool_name]
    assert status.kept and status.used == 1 and status.engines == ()
    assert tools.clean_pools({pool_name}) == []  # kept
    with _attach(pool_name) as pool:  # a restart finds what was stored
        _assert_exact(pool, [1])
        pool.keep = True
    assert tools.clean_pools({pool_name}, include_kept=True) == [pool_name]
    assert not os.path.exists(_path(pool_name))


def test_a_killed_last_engine_leaves_the_pool_to_clean(pool_name, procs):
    engine = procs(role="hold", **_args(pool_name), engine="gone")
    _wait_line(engine, "ATTACHED")
    status, = [s for s in tools.list_pools() if s.pool == pool_name]
    assert status.live_engines == 1
    assert tools.clean_pools({pool_name}) == []  # in use
    _kill(engine)
    status, = [s for s in tools.list_pools() if s.pool == pool_name]
    assert status.live_engines == 0 and status.engines[0][:2] == ("gone", engine.pid)
    assert tools.clean_pools({pool_name}) == [pool_name]
    assert not os.path.exists(_path(pool_name))
