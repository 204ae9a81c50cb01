"""Job/result rings: FIFO, exactly-once across real processes, backpressure, crashes, cleanup.

Every test uses a real segment and real POSIX semaphores; child processes are
spawned (never forked) and killed in ``finally`` blocks, so nothing is left in
/dev/shm even when an assertion fails (the conftest guard checks).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import threading
import time

import posix_ipc
import pytest

from shmtier.shared import ring as ring_mod
from shmtier.shared.jobs import Outcome, Result, decode_job, decode_result, encode_result, pack_job
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.ring import (
    RingAttachError,
    RingBusyError,
    RingCorruptError,
    RingSet,
    ring_area_nbytes,
    semaphore_name,
)
from shmtier.shared.ring_tools import clean_stale_ring_semaphores, list_ring_semaphores
from shmtier.shared.segment import open_segment

GEOMETRY = ArenaGeometry(num_chunks=4, row_stride=4096, page_size_per_worker=4096, world_size=1)
FP = "ring-tests"
WORKERS, SLOTS, SLOT_SIZE = 2, 64, 256
RINGS_LEN = ring_area_nbytes(WORKERS, SLOTS, SLOT_SIZE)
CTX = mp.get_context("spawn")


def _sems_of(segment_name: str) -> list[str]:
    prefix = "sem." + segment_name.lstrip("/") + "."
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(prefix))


@pytest.fixture
def rings(engine_id):
    """(segment, RingSet) created by this process as the scheduler would."""
    seg = open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=RINGS_LEN)
    try:
        rs = RingSet.for_segment(seg, create=True, num_workers=WORKERS, slots=SLOTS,
                                 slot_size=SLOT_SIZE)
    except BaseException:
        seg.close()
        raise
    try:
        yield seg, rs
    finally:
        rs.close()
        seg.close()


def _attach(engine_id, index):
    seg = open_segment(engine_id, GEOMETRY, FP, owner=False, rings_len=RINGS_LEN, prefault=False,
                       timeout_s=20)
    try:
        rs = RingSet.attach(seg.name, seg.rings, worker=index, timeout_s=20)
    except BaseException:
        seg.close()
        raise
    return seg, rs


def _stop_all(procs):
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(20)


# --- child process bodies (spawned: module level) ---

def _echo_worker(engine_id, index, batch):
    """Worker: answer every job with a result echoing its keys; exit on a stop job."""
    seg, rs = _attach(engine_id, index)
    w = rs.worker(index)
    try:
        w.claim()
        while True:
            for raw in w.jobs.get_many(batch, 1.0):
                job = decode_job(raw)
                if job.op == "stop":
                    return
                out = encode_result(Result(job.job_id, stored_bytes=[0] * len(job.keys),
                                           listed=job.keys))
                while not w.results.try_put(out):
                    time.sleep(0.0002)
            w.beat()
    finally:
        w.unclaim()
        rs.close()
        seg.close()


def _block_in_get(engine_id, index):
    """Worker: claim, say ready on the result ring, then sleep in get() until killed."""
    seg, rs = _attach(engine_id, index)
    w = rs.worker(index)
    w.claim()
    w.results.try_put(b"ready")
    w.jobs.get(None)
    os._exit(3)  # must not get here: nothing is put before the kill


def _take_tokens_then_die(engine_id, index, tokens):
    """Worker that dies holding item tokens it never turned into taken items."""
    seg, rs = _attach(engine_id, index)
    items = rs.worker(index).jobs._items
    for _ in range(tokens):
        items.acquire(5)
    os.kill(os.getpid(), signal.SIGKILL)


def _die_mid_write(engine_id, index):
    """Producer of the result ring killed after taking a space, in the middle of a slot."""
    seg, rs = _attach(engine_id, index)
    ring = rs.worker(index).results
    ring._spaces.acquire(0)
    ring._region[ring_mod.RING_HEADER_SIZE : ring_mod.RING_HEADER_SIZE + 20] = b"\xee" * 20
    os.kill(os.getpid(), signal.SIGKILL)


def _die_after_commit(engine_id, index, payload):
    """Producer killed after committing a slot (head moved) but before posting items.

    The state is made by hand, as try_put leaves it between its commit and its post:
    try_put is one C call (RingPort), so a kill cannot be aimed between the two."""
    seg, rs = _attach(engine_id, index)
    ring = rs.worker(index).results
    ring._spaces.acquire(0)
    head = ring.head
    off = ring_mod.RING_HEADER_SIZE + (head % ring.slots) * ring.slot_size
    struct.pack_into("<II", ring._region, off, len(payload), head & 0xFFFFFFFF)
    start = off + ring_mod.SLOT_HEADER_SIZE
    ring._region[start : start + len(payload)] = payload
    ring._ctr[ring_mod._HEAD] = head + 1  # commit; the item token is never posted
    os.kill(os.getpid(), signal.SIGKILL)


def _beat_worker(engine_id, index, beats, done):
    seg, rs = _attach(engine_id, index)
    w = rs.worker(index)
    try:
        w.claim()
        for _ in range(beats):
            w.beat()
            time.sleep(0.01)
        done.wait(20)
    finally:
        w.unclaim()
        rs.close()
        seg.close()


def _try_claim(engine_id, index, out):
    """A duplicate worker: claim, and unclaim on the way out (as the job loop does)."""
    seg, rs = _attach(engine_id, index)
    try:
        rs.worker(index).claim()
        out.put("claimed")
    except RingBusyError as exc:
        out.put(str(exc))
    finally:
        out.put(rs.worker(index).unclaim())
        rs.close()
        seg.close()


# --- single process ---

def test_fifo_byte_exact_with_wraparound(rings):
    _, rs = rings
    ring = rs.worker(1).jobs
    sizes = [0, 1, 7, 8, 100, ring.max_payload]
    sent = [bytes((i * 31 + j) % 256 for j in range(sizes[i % len(sizes)]))
            for i in range(5 * SLOTS)]
    got = []
    for i in range(0, len(sent), 40):
        for payload in sent[i : i + 40]:
            assert ring.try_put(payload)
        got += ring.get_many(17, 0)
        got += ring.get_many(100, 0)
    assert got == sent
    assert ring.head == ring.tail == len(sent) and ring.depth() == 0
    assert rs.worker(0).jobs.depth() == 0  # other rings untouched


def test_full_ring_returns_false_without_blocking_and_recovers(rings):
    _, rs = rings
    ring = rs.worker(0).results
    for i in range(SLOTS):
        assert ring.try_put(b"%d" % i)
    t0 = time.perf_counter()
    assert ring.try_put(b"x") is False
    assert time.perf_counter() - t0 < 0.05
    assert ring.depth() == SLOTS
    assert ring.get(0) == b"0"
    assert ring.try_put(b"again")
    assert ring.try_put(b"x") is False
    rest = ring.get_many(1000, 0)
    assert rest == [b"%d" % i for i in range(1, SLOTS)] + [b"again"]


def test_timeout_returns_none(rings):
    _, rs = rings
    ring = rs.worker(0).jobs
    t0 = time.monotonic()
    assert ring.get(0.1) is None
    assert 0.08 < time.monotonic() - t0 < 2
    assert ring.get_many(8, 0.02) == []
    assert ring.try_get() is None
    assert ring.get(0) is None


def test_python_signal_handler_does_not_cut_wait_short(rings):
    _, rs = rings
    ring = rs.worker(0).jobs
    hits = []
    old = signal.signal(signal.SIGUSR1, lambda *a: hits.append(1))
    main = threading.get_ident()
    timer = threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGUSR1))
    try:
        timer.start()
        t0 = time.monotonic()
        assert ring.get(0.3) is None
        assert time.monotonic() - t0 > 0.25 and hits
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)


def test_oversize_payload_names_both_sizes(rings):
    _, rs = rings
    ring = rs.worker(0).jobs
    assert ring.max_payload == SLOT_SIZE - 8
    with pytest.raises(ValueError, match=rf"{SLOT_SIZE - 7} bytes.*{SLOT_SIZE - 8} bytes"):
        ring.try_put(bytes(SLOT_SIZE - 7))
    assert ring.depth() == 0 and ring.try_put(bytes(SLOT_SIZE - 8))


def test_a_slot_that_is_not_the_expected_item_is_refused(rings):
    _, rs = rings
    ring = rs.worker(0).jobs
    assert ring.try_put(b"first") and ring.try_put(b"second")
    off = ring_mod.RING_HEADER_SIZE + 1 * ring.slot_size  # item 1's slot
    struct.pack_into("<I", ring._region, off + 4, 77)  # a foreign sequence number
    with pytest.raises(RingCorruptError, match=r"slot 1 holds item 77 of 6 bytes where item 1"):
        ring.get_many(8, 0)


def test_tokens_without_items_are_dropped_with_a_warning(rings, caplog):
    _, rs = rings
    ring = rs.worker(0).jobs
    assert ring.try_put(b"only")
    ring._items.release()  # an over-release: two tokens, one item
    with caplog.at_level("WARNING", logger="shmtier.shared.ring"):
        assert ring.get_many(8, 0) == [b"only"]
    assert "1 item token(s) without an item dropped" in caplog.text
    assert ring.get_many(8, 0) == [] and ring.try_put(b"next") and ring.get(0) == b"next"


def test_max_items_below_one_and_a_closed_ring_are_clear_errors(engine_id):
    seg = open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=RINGS_LEN)
    try:
        rs = RingSet.for_segment(seg, create=True, num_workers=WORKERS, slots=SLOTS,
                                 slot_size=SLOT_SIZE)
        ring = rs.worker(0).jobs
        for timeout_s in (0, 0.01):
            with pytest.raises(ValueError, match="max_items must be >= 1, got 0"):
                ring.get_many(0, timeout_s)
        rs.close()
        with pytest.raises(ValueError, match="ring port is closed"):
            ring.try_put(b"x")
    finally:
        seg.close()  # the closed ports hold no view of the segment


def test_bad_geometry_and_small_area(engine_id):
    with pytest.raises(ValueError, match="slot_size=12"):
        ring_area_nbytes(1, 4, 12)
    with pytest.raises(ValueError, match="num_workers=0"):
        ring_area_nbytes(0, 4, 64)
    with open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=4096) as seg:
        with pytest.raises(ValueError, match="rings_len=ring_area_nbytes"):
            RingSet.for_segment(seg, create=True, num_workers=8, slots=64, slot_size=256)
        assert _sems_of(seg.name) == []
    with pytest.raises(ValueError, match="251"):
        semaphore_name("/shmtier_" + "x" * 240, 1, "job", "items")


def test_attach_checks_geometry(rings):
    seg, _ = rings
    with pytest.raises(RingAttachError, match="slots is 64 in the segment, 32 expected"):
        RingSet.attach(seg.name, seg.rings, slots=32)
    with pytest.raises(RingAttachError, match="worker 5 does not exist"):
        RingSet.attach(seg.name, seg.rings, worker=5)


def test_attach_before_creation_or_to_missing_semaphore_is_a_clear_error(engine_id):
    with open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=RINGS_LEN) as seg:
        t0 = time.monotonic()
        with pytest.raises(RingAttachError, match=f"rings of segment {seg.name} were not created"):
            RingSet.attach(seg.name, seg.rings, timeout_s=0.2)
        assert time.monotonic() - t0 < 5
        rs = RingSet.for_segment(seg, create=True, num_workers=WORKERS, slots=SLOTS,
                                 slot_size=SLOT_SIZE)
        try:
            missing = semaphore_name(seg.name, 1, "res", "spaces")
            posix_ipc.unlink_semaphore(missing)
            with pytest.raises(RingAttachError, match=f"ring semaphore {missing} .*does not exist"):
                RingSet.attach(seg.name, seg.rings, worker=1, timeout_s=0.2)
            ok = RingSet.attach(seg.name, seg.rings, worker=0, timeout_s=0.2)
            ok.close()
        finally:
            rs.close()
        # after the creator closed (and unlinked) the rings, attaching fails fast too
        with pytest.raises(RingAttachError, match="were not created"):
            RingSet.attach(seg.name, seg.rings, timeout_s=0.1)


def test_close_unlinks_every_semaphore_and_is_idempotent(engine_id):
    with open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=RINGS_LEN) as seg:
        rs = RingSet.for_segment(seg, create=True, num_workers=WORKERS, slots=SLOTS,
                                 slot_size=SLOT_SIZE)
        assert len(_sems_of(seg.name)) == 4 * WORKERS
        assert all(n.startswith(seg.name + ".w") for n in list_ring_semaphores()
                   if n.startswith(seg.name + "."))
        mode = os.stat("/dev/shm/" + _sems_of(seg.name)[0]).st_mode & 0o777
        assert mode == 0o600
        rs.unlink()
        assert _sems_of(seg.name) == []
        rs.unlink()
        rs.close()
        rs.close()
        with pytest.raises(KeyError):
            rs.worker(0)
    assert not [e for e in os.listdir("/dev/shm") if seg.name.lstrip("/") in e]


def test_failed_creation_removes_what_it_created(engine_id, monkeypatch):
    calls = []
    real = ring_mod._create_sem

    def failing(name, value):
        calls.append(name)
        if len(calls) == 6:
            raise OSError("injected: no more semaphores")
        return real(name, value)

    monkeypatch.setattr(ring_mod, "_create_sem", failing)
    with open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=RINGS_LEN) as seg:
        with pytest.raises(OSError, match="injected"):
            RingSet.for_segment(seg, create=True, num_workers=WORKERS, slots=SLOTS,
                                slot_size=SLOT_SIZE)
        assert len(calls) == 6
        assert _sems_of(seg.name) == []
        assert bytes(seg.rings[:8]) == bytes(8)  # never marked ready


def test_stale_semaphores_are_replaced_and_cleaned(engine_id):
    with open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=RINGS_LEN) as seg:
        stale = posix_ipc.Semaphore(semaphore_name(seg.name, 0, "job", "items"),
                                    posix_ipc.O_CREX, initial_value=7)
        stale.close()
        rs = RingSet.for_segment(seg, create=True, num_workers=WORKERS, slots=SLOTS,
                                 slot_size=SLOT_SIZE)
        assert rs.worker(0).jobs.try_get() is None  # fresh semaphore, value 0
        rs.close(unlink=False)  # as if the scheduler crashed
        assert len(_sems_of(seg.name)) == 4 * WORKERS
        assert not set(clean_stale_ring_semaphores({seg.name})) & {"/" + e[4:] for e in _sems_of(seg.name)}
        assert len(_sems_of(seg.name)) == 4 * WORKERS
    removed = clean_stale_ring_semaphores({seg.name})
    assert set(semaphore_name(seg.name, w, k, s) for w in range(WORKERS)
               for k in ("job", "res") for s in ("items", "spaces")) <= set(removed)
    assert _sems_of(seg.name) == []


# --- real processes ---

def test_exactly_once_through_two_worker_processes(rings, engine_id):
    seg, rs = rings
    n = 100_000
    procs = [CTX.Process(target=_echo_worker, args=(engine_id, i, 32)) for i in range(WORKERS)]
    for p in procs:
        p.start()
    try:
        key = [i.to_bytes(8, "little") * 3 for i in range(n)]
        seen = bytearray(n)
        wrong = []
        sent = received = 0
        workers = rs.workers

        def collect(timeout):
            nonlocal received
            got = 0
            for w in workers:
                for raw in w.results.get_many(256, timeout if got == 0 else 0):
                    r = decode_result(raw)
                    seen[r.job_id] += 1
                    if r.listed != [key[r.job_id]] or r.job_id % WORKERS != w.index:
                        wrong.append(r.job_id)
                    got += 1
            received += got
            return got

        deadline = time.monotonic() + 60
        while received < n:
            while sent < n and workers[sent % WORKERS].jobs.try_put(
                    pack_job(sent, "store", 1, [key[sent]], [sent % 4])):
                sent += 1
            if not collect(0) and time.monotonic() < deadline:
                collect(0.005)
            assert time.monotonic() < deadline, f"stalled: sent {sent}, received {received}"
        for w in workers:
            assert w.jobs.try_put(pack_job(n + w.index, "stop", 0, []))
        for p in procs:
            p.join(20)
            assert p.exitcode == 0
        assert not wrong
        assert seen.count(1) == n  # every job answered exactly once
        for w in workers:
            assert w.jobs.depth() == 0 and w.results.depth() == 0
            assert w.last_beat().pid == 0  # workers unclaimed on exit
    finally:
        _stop_all(procs)


def test_consumer_killed_while_blocked_and_replacement_continues(rings, engine_id):
    seg, rs = rings
    w = rs.worker(0)
    first = CTX.Process(target=_block_in_get, args=(engine_id, 0))
    first.start()
    replacement = None
    try:
        assert w.results.get(20) == b"ready"
        assert w.last_beat().pid == first.pid and w.holder_alive()
        time.sleep(0.2)  # let it reach sem_wait
        os.kill(first.pid, signal.SIGKILL)
        first.join(20)
        assert not w.holder_alive()
        for i in range(5):
            assert w.jobs.try_put(pack_job(i, "load", 0, [b"k%d" % i], [i]))
        assert w.recover() == (5, 0)  # no token was lost: nothing to fix
        replacement = CTX.Process(target=_echo_worker, args=(engine_id, 0, 2))
        replacement.start()
        got = []
        while len(got) < 5:
            raw = w.results.get(20)
            assert raw is not None, "replacement did not answer"
            got.append(decode_result(raw).job_id)
        assert got == list(range(5))
        assert w.jobs.try_put(pack_job(99, "stop", 0, []))
        replacement.join(20)
        assert replacement.exitcode == 0
        assert w.last_beat().claims == 2
    finally:
        _stop_all([first] + ([replacement] if replacement else []))


def test_consumer_killed_holding_tokens_is_resynced(rings, engine_id):
    seg, rs = rings
    w = rs.worker(1)
    for i in range(3):
        assert w.jobs.try_put(pack_job(i, "probe", 0, [b"p%d" % i]))
    dead = CTX.Process(target=_take_tokens_then_die, args=(engine_id, 1, 2))
    dead.start()
    replacement = None
    try:
        dead.join(20)
        assert dead.exitcode == -signal.SIGKILL
        assert w.jobs._items.value == 1 and w.jobs.depth() == 3 and w.jobs.tail == 0
        assert w.recover() == (3, 0)
        assert w.jobs._items.value == 3
        replacement = CTX.Process(target=_echo_worker, args=(engine_id, 1, 8))
        replacement.start()
        got = [decode_result(w.results.get(20)).job_id for _ in range(3)]
        assert got == [0, 1, 2]
        assert w.jobs.try_put(pack_job(9, "stop", 0, []))
        replacement.join(20)
        assert replacement.exitcode == 0
    finally:
        _stop_all([dead] + ([replacement] if replacement else []))


def test_recover_can_discard_pending_jobs(rings):
    _, rs = rings
    w = rs.worker(0)
    for i in range(4):
        assert w.jobs.try_put(b"job%d" % i)
    assert w.jobs.get(0) == b"job0"
    assert w.recover(discard_jobs=True) == (0, 0)
    assert w.jobs.get(0) is None
    assert [w.jobs.try_put(b"%d" % i) for i in range(SLOTS + 1)] == [True] * SLOTS + [False]


def test_producer_killed_mid_write_or_before_post(rings, engine_id):
    seg, rs = rings
    w = rs.worker(0)
    procs = []
    try:
        p = CTX.Process(target=_die_mid_write, args=(engine_id, 0))
        procs.append(p)
        p.start()
        p.join(20)
        assert p.exitcode == -signal.SIGKILL
        assert w.results.depth() == 0 and w.results._spaces.value == SLOTS - 1
        assert w.results.get(0) is None  # the torn slot was never committed
        assert w.recover() == (0, 0)
        assert w.results._spaces.value == SLOTS

        payload = encode_result(Result(41, [Outcome.OK], [10], [7], [0.5], 0.25))
        p = CTX.Process(target=_die_after_commit, args=(engine_id, 0, payload))
        procs.append(p)
        p.start()
        p.join(20)
        assert p.exitcode == -signal.SIGKILL
        assert w.results.depth() == 1 and w.results.get(0) is None  # committed, no token
        assert w.recover() == (0, 1)
        assert w.results.get(0) == payload  # complete and intact
        assert w.results.depth() == 0
    finally:
        _stop_all(procs)


def test_heartbeat_visible_across_processes(rings, engine_id):
    seg, rs = rings
    w = rs.worker(1)
    assert w.last_beat().beat_ns == 0 and w.last_beat().age_s() == float("inf")
    done = CTX.Event()
    p = CTX.Process(target=_beat_worker, args=(engine_id, 1, 30, done))
    p.start()
    try:
        deadline = time.monotonic() + 20
        while w.last_beat().pid != p.pid:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first = w.last_beat().beat_ns
        time.sleep(0.1)
        hb = w.last_beat()
        assert hb.beat_ns > first and hb.age_s() < 5 and w.holder_alive()
        out = CTX.Queue()
        rival = CTX.Process(target=_try_claim, args=(engine_id, 1, out))
        rival.start()
        assert f"held by live pid {p.pid}" in out.get(timeout=20)
        assert out.get(timeout=20) is False  # its unclaim left the holder's record alone
        rival.join(20)
        assert w.last_beat().pid == p.pid and w.holder_alive()
        done.set()
        p.join(20)
        assert p.exitcode == 0
        assert w.last_beat().pid == 0 and not w.holder_alive()
    finally:
        done.set()
        _stop_all([p])


def test_owner_alive_seen_by_attacher(rings, engine_id):
    seg, rs = rings
    seg2, att = _attach(engine_id, 0)
    try:
        assert att.owner_alive()
        assert att.worker(0).jobs.slots == SLOTS
        with pytest.raises(KeyError, match="not attached"):
            att.worker(1)
    finally:
        att.close()
        seg2.close()
    assert att.closed and not att.workers
