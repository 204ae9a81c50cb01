"""The segment: creator/joiner protocol, checks on attach, stale handling, no leaks."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat

import numpy as np
import posix_ipc
import pytest

from shmtier.shared import segment as seg
from shmtier.shared.layout import HEADER_SIZE, ArenaGeometry, SegmentLayout
from shmtier.shared.segment import (
    SegmentMismatchError,
    SegmentOwnedError,
    SegmentTimeoutError,
    open_segment,
    segment_name,
)
from shmtier.shared.segment_tools import clean_stale_segments, list_segments

GEOMETRY = ArenaGeometry(num_chunks=8, row_stride=8192, page_size_per_worker=4096, world_size=2)
FP = "model=m dtype=bf16 block=16x4"
CTX = mp.get_context("spawn")


def _member(engine_id, rank, row, value, ready, done):
    """Child: join as a GPU-rank member, write ``value`` into its slot of ``row``."""
    s = open_segment(engine_id, GEOMETRY, FP, owner=False, rank=rank, timeout_s=20)
    arena = np.asarray(s.arena_rows())
    arena[row, rank * GEOMETRY.page_size_per_worker] = value
    was_creator = s.is_creator
    del arena
    ready.put(was_creator)
    done.wait(20)
    s.close()


def _owner_then_hang(engine_id, ready):
    s = open_segment(engine_id, GEOMETRY, FP, owner=True)
    np.asarray(s.arena_rows())[1, 7] = 42
    ready.put(os.getpid())
    signal.pause()


def _start_member(engine_id, rank, row, value):
    ready, done = CTX.Queue(), CTX.Event()
    p = CTX.Process(target=_member, args=(engine_id, rank, row, value, ready, done))
    p.start()
    return p, ready, done


def _finish(p, done):
    done.set()
    p.join(20)
    if p.is_alive():
        p.kill()
        p.join()
    assert p.exitcode == 0


def test_owner_first_then_member_process(engine_id):
    with open_segment(engine_id, GEOMETRY, FP, owner=True) as owner:
        assert owner.is_creator and owner.is_owner
        p, ready, done = _start_member(engine_id, 1, 3, 99)
        try:
            assert ready.get(timeout=20) is False  # joined, did not create
            assert np.asarray(owner.arena_rows())[3, GEOMETRY.page_size_per_worker] == 99
        finally:
            _finish(p, done)
        mode = stat.S_IMODE(os.stat(owner.path).st_mode)
        assert mode == 0o600
    assert not os.path.exists(owner.path)


def test_member_first_then_owner(engine_id):
    p, ready, done = _start_member(engine_id, 0, 5, 17)
    try:
        assert ready.get(timeout=20) is True  # the member created it
        with open_segment(engine_id, GEOMETRY, FP, owner=True) as owner:
            assert not owner.is_creator and owner.is_owner
            assert owner.header().owner_pid == os.getpid()
            assert np.asarray(owner.arena_rows())[5, 0] == 17
            _finish(p, done)  # member closes: owner claimed it, so the name stays
            assert os.path.exists(owner.path)
    finally:
        if p.is_alive():
            _finish(p, done)
    assert segment_name(engine_id).lstrip("/") not in os.listdir("/dev/shm")


def test_simultaneous_openers_agree_on_one_creator(engine_id):
    procs = [_start_member(engine_id, rank % 2, rank, rank + 1) for rank in range(4)]
    try:
        creators = [ready.get(timeout=30) for _, ready, _ in procs]
        assert creators.count(True) == 1
        with open_segment(engine_id, GEOMETRY, FP, owner=True) as owner:
            arena = np.asarray(owner.arena_rows())
            for rank in range(4):
                assert arena[rank, (rank % 2) * GEOMETRY.page_size_per_worker] == rank + 1
            del arena
            for p, _, done in procs:
                _finish(p, done)
    finally:
        for p, _, done in procs:
            if p.is_alive():
                _finish(p, done)


def test_geometry_and_fingerprint_mismatch_names_both_values(engine_id):
    with open_segment(engine_id, GEOMETRY, FP, owner=True):
        other = ArenaGeometry(num_chunks=16, row_stride=8192, page_size_per_worker=4096, world_size=2)
        with pytest.raises(SegmentMismatchError) as err:
            open_segment(engine_id, other, "model=other", owner=False, rank=0)
        text = str(err.value)
        assert "num_chunks is 8 in the segment, 16 expected" in text
        assert repr(FP) in text and "'model=other'" in text


def test_second_live_owner_is_refused(engine_id):
    ready = CTX.Queue()
    p = CTX.Process(target=_owner_then_hang, args=(engine_id, ready))
    p.start()
    try:
        pid = ready.get(timeout=20)
        with pytest.raises(SegmentOwnedError, match=f"pid {pid}"):
            open_segment(engine_id, GEOMETRY, FP, owner=True)
    finally:
        p.kill()
        p.join()
        clean_stale_segments({segment_name(engine_id)})


def test_sigkilled_owner_leaves_a_stale_segment_that_clean_removes(engine_id):
    ready = CTX.Queue()
    p = CTX.Process(target=_owner_then_hang, args=(engine_id, ready))
    p.start()
    try:
        ready.get(timeout=20)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        mine = [s for s in list_segments() if s.name == segment_name(engine_id)]
        assert len(mine) == 1 and not mine[0].alive
        assert clean_stale_segments({segment_name(engine_id)}) == [segment_name(engine_id)]
        assert not [s for s in list_segments() if s.name == segment_name(engine_id)]
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def _make_stale_segment(engine_id):
    """A segment whose owner was SIGKILLed after writing 42 at row 1, byte 7."""
    ready = CTX.Queue()
    p = CTX.Process(target=_owner_then_hang, args=(engine_id, ready))
    p.start()
    ready.get(timeout=20)
    os.kill(p.pid, signal.SIGKILL)
    p.join()


def test_warm_restart_reattaches_to_a_stale_segment(engine_id):
    _make_stale_segment(engine_id)
    with open_segment(engine_id, GEOMETRY, FP, owner=True, warm_restart=True) as s:
        assert not s.is_creator
        assert np.asarray(s.arena_rows())[1, 7] == 42
        assert s.header().generation == 2  # claimed twice


def test_warm_restart_refuses_a_changed_layout(engine_id):
    _make_stale_segment(engine_id)
    try:
        with pytest.raises(SegmentMismatchError, match="fingerprint"):
            open_segment(engine_id, GEOMETRY, "model=changed", owner=True, warm_restart=True)
    finally:
        clean_stale_segments({segment_name(engine_id)})


def test_stale_segment_is_replaced_without_warm_restart(engine_id):
    _make_stale_segment(engine_id)
    with open_segment(engine_id, GEOMETRY, FP, owner=True) as s:
        assert s.is_creator
        assert np.asarray(s.arena_rows())[1, 7] == 0


def test_joiner_times_out_with_a_clear_error_while_creator_is_alive(engine_id):
    name = segment_name(engine_id)
    layout = SegmentLayout.for_geometry(GEOMETRY)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=HEADER_SIZE)
    try:
        os.pwrite(shm.fd, seg._encode_header(layout, FP), 0)  # state stays INITIALISING
        with pytest.raises(SegmentTimeoutError, match=f"creator pid {os.getpid()}"):
            open_segment(engine_id, GEOMETRY, FP, owner=False, rank=0, timeout_s=0.2)
    finally:
        shm.close_fd()
        shm.unlink()


def _die_while_initialising(engine_id):
    layout = SegmentLayout.for_geometry(GEOMETRY)
    shm = posix_ipc.SharedMemory(segment_name(engine_id), posix_ipc.O_CREX, mode=0o600,
                                 size=HEADER_SIZE)
    os.pwrite(shm.fd, seg._encode_header(layout, FP), 0)
    os._exit(0)


def test_creator_dying_mid_initialisation_is_replaced(engine_id):
    p = CTX.Process(target=_die_while_initialising, args=(engine_id,))
    p.start()
    p.join(20)
    with open_segment(engine_id, GEOMETRY, FP, owner=False, rank=0, timeout_s=5) as s:
        assert s.is_creator


def test_unclaimed_creator_unlinks_on_close(engine_id):
    s = open_segment(engine_id, GEOMETRY, FP, owner=False, rank=0)
    path = s.path
    assert os.path.exists(path)
    s.close()
    assert not os.path.exists(path)


def test_layout_is_page_aligned_and_control_fits_budget():
    big = ArenaGeometry(num_chunks=10_000, row_stride=2 << 20, page_size_per_worker=1 << 20,
                        world_size=2)
    layout = SegmentLayout.for_geometry(big)
    assert layout.arena_off % (2 << 20) == 0
    assert layout.control_len / big.num_chunks <= 256  # docs/design.md §9 memory budget


def test_vllm_row_geometry():
    # docs/vllm-contract.md §1.9 example: ~1 MiB per worker per block, TP=2, 10 GiB
    g = ArenaGeometry.for_kv(cpu_bytes_to_use=10 << 30, worker_kv_bytes_per_block=1 << 20,
                             blocks_per_chunk=1, world_size=2)
    assert (g.num_chunks, g.row_stride, g.page_size_per_worker) == (5120, 2 << 20, 1 << 20)
    odd = ArenaGeometry.for_kv(cpu_bytes_to_use=1 << 20, worker_kv_bytes_per_block=1000,
                               blocks_per_chunk=3, world_size=2)
    assert odd.row_stride == 8192 and odd.page_size_per_worker == 3000
    assert odd.num_chunks == (1 << 20) // 8192


def test_ring_area_is_reserved_and_checked(engine_id):
    with open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=5000) as s:
        assert len(s.rings) == 8192  # page rounded
        assert s.layout.arena_off >= s.layout.rings_off + 8192
        with pytest.raises(SegmentMismatchError, match="ring area is 8192 bytes in the segment, 0 expected"):
            open_segment(engine_id, GEOMETRY, FP, owner=False, rank=0)


def test_too_little_free_space_refuses_before_anything_grows(engine_id, monkeypatch):
    """The creator compares size + reserve with /dev/shm's free space (tests/test_shm_space.py
    runs the real thing on a small tmpfs); the name is unlinked again."""
    layout = SegmentLayout.for_geometry(GEOMETRY, 5000)
    free = layout.total_len  # the segment alone would fit, not with the reserve
    monkeypatch.setattr(seg, "shm_free_bytes", lambda shm_dir=seg.SHM_DIR: free)
    with pytest.raises(seg.SegmentSpaceError) as info:
        open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=5000, reserve_bytes=4096)
    e = info.value
    assert (e.size, e.reserve, e.free, e.shm_dir) == (layout.total_len, 4096, free, "/dev/shm")
    assert str(e) == (
        f"segment {segment_name(engine_id)} needs {layout.total_len} bytes "
        f"({seg.human_bytes(layout.total_len)}) plus 4096 bytes for its ring semaphores on "
        f"/dev/shm, which has {free} bytes ({seg.human_bytes(free)}) free: make the segment "
        f"smaller or give /dev/shm more room (Docker: --shm-size)")
    assert not os.path.exists(os.path.join("/dev/shm", segment_name(engine_id).lstrip("/")))


def test_joining_is_never_refused_for_space(engine_id, monkeypatch):
    """Only the creator needs room: a full /dev/shm does not stop ranks joining."""
    with open_segment(engine_id, GEOMETRY, FP, owner=True, reserve_bytes=4096) as owner:
        monkeypatch.setattr(seg, "shm_free_bytes", lambda shm_dir=seg.SHM_DIR: 0)
        with open_segment(engine_id, GEOMETRY, FP, owner=False, rank=1,
                          reserve_bytes=4096) as member:
            assert not member.is_creator and owner.is_creator


def test_created_segment_has_every_page_allocated(engine_id):
    """posix_fallocate reserved the whole object, so no later page fault can SIGBUS."""
    with open_segment(engine_id, GEOMETRY, FP, owner=False, rank=0, prefault=False) as s:
        st = os.stat(s.path)
        assert st.st_blocks * 512 >= s.layout.total_len


def test_human_bytes():
    assert [seg.human_bytes(n) for n in (0, 1023, 4096, 136314880, 1 << 50)] == [
        "0 bytes", "1023 bytes", "4.0 KiB", "130.0 MiB", "1.0 PiB"]
