"""An engine killed outright leaves nothing in /dev/shm unless it keeps its segment for a
warm restart (issue 27; ``shmtier/shared/segment_guardian.py``).

Each engine is a child process that builds the core spec's manager (the scheduler
process, as vLLM's EngineCore does) and is SIGKILLed: alone, or with every process
descended from it first, as vLLM stops an EngineCore at its default
``--shutdown-timeout 0``. Within a few seconds the engine's segment and ring semaphores
must be gone and none of its processes (tier workers, guardian) left; with
``warm_restart`` the segment stays, and a new engine that opens its GPU worker first
(vLLM's order) and then its scheduler re-attaches and serves the old rows byte for byte.
Real processes, segments, semaphores and files; everything is removed also on failure.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from fs_engine import GPU_BLOCKS, HIT, key
from test_pool import _unlink_ours, wait_up

from shmtier.config import KVLayout
from shmtier.shared import procinfo
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.segment import open_segment, segment_name
from shmtier.shared.segment_tools import remove_if_stale
from shmtier.shared.segment_guardian import guardian_pids

CTX = mp.get_context("spawn")
PAGE = 8192
LAYOUT = KVLayout("m", "bfloat16", 16, PAGE, 1)
CHUNKS = 16
SEED = 27
GONE_WITHIN_S = 5.0  # "within a few seconds"; it takes well under one here


def _extra(root: str | None, *, workers: str | None = None, warm: bool = False) -> dict:
    extra = {"cpu_bytes_to_use": CHUNKS * PAGE, "warm_restart": warm}
    if root is not None:
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": root, "min_free_bytes": None}]
        extra["num_tier_workers"] = 2
    if workers is not None:
        extra["workers"] = workers
    return extra


def _engine(engine_id: str, extra: dict, store: int, conn) -> None:
    """Child: the scheduler process of an engine (the spec's manager), with its tier
    workers up (spawn mode); with ``store`` > 0 also a GPU rank (CPU tensors) that
    offloads that many seeded chunks. Reports its processes, then waits to be killed."""
    from shmtier.spec import TieringOffloadingSpec

    spec = TieringOffloadingSpec(extra, LAYOUT, engine_id)
    manager = spec.get_manager()
    if spec.worker_pool is not None and spec.worker_pool.mode == "spawn":
        wait_up(SimpleNamespace(pool=spec.worker_pool))
    if store:
        _offload(spec, manager, store)
    guardian = manager.primary.segment.guardian
    conn.send({"pid": os.getpid(), "guardian": guardian and guardian.pid,
               "workers": procinfo.tier_worker_pids(engine_id)})
    time.sleep(120)  # killed by the test long before


def _caches(n: int):
    import torch

    torch.manual_seed(SEED)
    return torch.randint(-128, 128, (GPU_BLOCKS, PAGE), dtype=torch.int8)[:n].clone()


def _rank(spec, cache):
    from shmtier.gpu.canonical import CanonicalKVCacheRef, CanonicalKVCaches

    return spec.get_worker(CanonicalKVCaches([cache], [[CanonicalKVCacheRef(0, PAGE)]]), 0)


def _copy(worker, kind: str, cpu_spec, blocks: list[int], job: int) -> None:
    from shmtier.contract import GPULoadStoreSpec

    gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
    (worker.submit_store if kind == "store" else worker.submit_load)(
        job, *((gpu, cpu_spec) if kind == "store" else (cpu_spec, gpu)))
    worker.wait({job})
    assert all(r.success for r in worker.get_finished())


def _offload(spec, manager, n: int) -> None:
    import torch

    from shmtier.contract import ReqContext

    cache = torch.zeros((GPU_BLOCKS, PAGE), dtype=torch.int8)
    cache[:n] = _caches(n)
    worker = _rank(spec, cache)
    keys, ctx = [key(i) for i in range(n)], ReqContext("before")
    with manager.lock:
        out = manager.prepare_store(keys, ctx)
    _copy(worker, "store", out.store_spec, list(range(n)), 1)
    with manager.lock:
        manager.complete_store(keys, ctx)
        manager.on_request_finished(ctx)


def _descendants(pid: int) -> list[int]:
    """Every process descended from ``pid`` (by parent pid, read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(pid: int, tree: bool) -> None:
    """SIGKILL ``pid``; with ``tree`` every descendant first, as vLLM stops an EngineCore."""
    for child in _descendants(pid) if tree else []:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(pid, signal.SIGKILL)


def _ours(engine_id: str) -> list[str]:
    """/dev/shm entries of ``engine_id``: its segment and its ring semaphores."""
    base = segment_name(engine_id).lstrip("/")
    return sorted(e for e in os.listdir("/dev/shm") if e == base or e.startswith(f"sem.{base}."))


def _live(pids) -> list[int]:
    boot = procinfo.boot_id()
    return [p for p in pids if (s := procinfo.start_time(p)) is not None
            and procinfo.is_alive(p, s, boot)]


class _Crash:
    """An engine in a child process, killed by the test; cleans up whatever happens."""

    def __init__(self, engine_id: str, extra: dict, store: int = 0):
        self.engine_id = engine_id
        parent, child_conn = CTX.Pipe()
        self.child = CTX.Process(target=_engine, args=(engine_id, extra, store, child_conn))
        self.child.start()
        deadline = time.monotonic() + 120
        while not parent.poll(0.1):
            assert self.child.is_alive() and time.monotonic() < deadline, (
                "the engine did not start")
        self.info = parent.recv()
        self.killed_at = None

    def kill(self, tree: bool) -> None:
        _kill(self.child.pid, tree)
        self.killed_at = time.monotonic()
        self.child.join(10)

    def wait_gone(self, pids) -> float:
        """Seconds from the kill until nothing of the engine is in /dev/shm and none of
        ``pids`` runs; fails after GONE_WITHIN_S."""
        while _ours(self.engine_id) or _live(pids):
            waited = time.monotonic() - self.killed_at
            assert waited < GONE_WITHIN_S, (
                f"{waited:.1f} s after the kill: /dev/shm still holds {_ours(self.engine_id)}, "
                f"processes {_live(pids)} still run")
            time.sleep(0.01)
        return time.monotonic() - self.killed_at

    def close(self) -> None:
        if self.child.is_alive():
            self.child.kill()
        self.child.join(10)
        name = segment_name(self.engine_id)
        for pid in _live(guardian_pids(name) + procinfo.tier_worker_pids(self.engine_id)):
            os.kill(pid, signal.SIGKILL)
        _unlink_ours(self.engine_id)


@pytest.fixture
def crash(engine_id):
    made: list[_Crash] = []

    def make(extra: dict, **kw) -> _Crash:
        c = _Crash(engine_id, extra, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_a_killed_engine_without_secondary_tiers_leaves_nothing(crash):
    """(a) No tier worker at all: the guardian alone removes the segment."""
    c = crash(_extra(None))
    guardian = c.info["guardian"]
    assert guardian and not c.info["workers"]
    assert guardian not in _descendants(c.child.pid)  # out of reach of a tree kill
    assert _ours(c.engine_id) == [segment_name(c.engine_id).lstrip("/")]
    c.kill(tree=True)
    took = c.wait_gone([guardian])
    print(f"\nsegment removed {took * 1000:.0f} ms after the kill")


@pytest.mark.parametrize("tree", [True, False], ids=["tree-kill", "engine-only"])
def test_a_killed_engine_with_tier_workers_leaves_nothing(crash, tmp_path, tree):
    """(b) fs tier, 2 spawned tier workers: 8 ring semaphores beside the segment. Killed
    with its descendants (vLLM: the workers die with it) or alone (the workers see their
    owner gone and exit by themselves, within their 1 s owner check)."""
    c = crash(_extra(str(tmp_path)))
    workers, guardian = c.info["workers"], c.info["guardian"]
    assert len(workers) == 2 and guardian
    assert len(_ours(c.engine_id)) == 1 + 8
    c.kill(tree=tree)
    took = c.wait_gone(workers + [guardian])
    print(f"\nsegment and 8 semaphores removed, workers gone {took * 1000:.0f} ms after "
          f"the kill")


def test_a_killed_engine_with_external_workers_leaves_nothing(crash, tmp_path):
    """External tier workers (``shmtier workers``, not the engine's descendants): the
    guardian removes the segment and semaphores as in spawn mode, and the external pool
    exits with its workers once the owner is gone."""
    c = crash(_extra(str(tmp_path), workers="external"))
    pool = subprocess.Popen([sys.executable, "-m", "shmtier", "workers", "--engine-id",
                             c.engine_id], stdout=subprocess.PIPE, text=True)
    try:
        assert "2 tier workers" in pool.stdout.readline()
        deadline = time.monotonic() + 30
        while len(workers := procinfo.tier_worker_pids(c.engine_id)) < 2:
            assert time.monotonic() < deadline, "the external tier workers did not start"
            time.sleep(0.05)
        c.kill(tree=True)
        took = c.wait_gone(workers + [c.info["guardian"], pool.pid])
        assert pool.wait(5) == 0
        print(f"\nexternal pool: everything gone {took * 1000:.0f} ms after the kill")
    finally:
        if pool.poll() is None:
            pool.kill()
        pool.wait(10)
        pool.stdout.close()


def test_with_warm_restart_the_segment_stays_and_a_new_engine_reattaches(crash, tmp_path):
    """(c) ``warm_restart``: no guardian; after the kill the segment and its semaphores
    stay, and a new engine that opens its GPU rank first (vLLM's order) and then its
    scheduler re-attaches: the rows the dead one stored are HITs in the CPU tier and load
    byte for byte."""
    import torch

    from shmtier.contract import ReqContext
    from shmtier.spec import TieringOffloadingSpec

    extra = _extra(str(tmp_path), warm=True)
    n = 6
    c = crash(extra, store=n)
    assert c.info["guardian"] is None
    kept = _ours(c.engine_id)
    assert len(kept) == 1 + 8
    c.kill(tree=True)
    time.sleep(1.5)  # longer than a guardian or a worker's owner check takes
    assert _ours(c.engine_id) == kept
    spec = TieringOffloadingSpec(extra, LAYOUT, c.engine_id)
    cache = torch.zeros((GPU_BLOCKS, PAGE), dtype=torch.int8)
    worker = _rank(spec, cache)  # first, as in vLLM: joins the dead owner's segment
    manager = None
    try:
        manager = spec.get_manager()
        segment = manager.primary.segment
        assert not segment.is_creator and segment.guardian is None
        keys, ctx = [key(i) for i in range(n)], ReqContext("again")
        with manager.lock:
            assert [manager.lookup(k, ctx) for k in keys] == [HIT] * n
            load = manager.prepare_load(keys, ctx)
        dst = list(range(GPU_BLOCKS - n, GPU_BLOCKS))
        _copy(worker, "load", load, dst, 1)
        with manager.lock:
            manager.complete_load(keys, ctx)
        assert torch.equal(cache[dst], _caches(n))
    finally:
        worker.shutdown()
        if manager is not None:
            manager.shutdown()
    assert not _ours(c.engine_id)


def test_the_guardian_exits_when_the_owner_closes_its_segment(engine_id, tmp_path):
    """A clean shutdown: the owner unlinks, its guardian exits touching nothing; the
    process goes on (tests build many engines in one process)."""
    from shmtier.spec import TieringOffloadingSpec

    manager = TieringOffloadingSpec(_extra(str(tmp_path)), LAYOUT, engine_id).get_manager()
    try:
        guardian = manager.primary.segment.guardian
        assert guardian_pids(segment_name(engine_id)) == [guardian.pid]
        assert guardian.pid not in _descendants(os.getpid())
    finally:
        manager.shutdown()
    deadline = time.monotonic() + GONE_WITHIN_S
    while _live([guardian.pid]):
        assert time.monotonic() < deadline, "the guardian outlived its owner's clean shutdown"
        time.sleep(0.01)
    assert not _ours(engine_id)


def _owner(engine_id: str, guard: bool, conn) -> None:
    """Child: own a small segment (with a guardian if ``guard``), then wait to be killed."""
    seg = open_segment(engine_id, ArenaGeometry(4, 4096, 4096, 1), "fp", owner=True)
    conn.send((seg.remove_when_owner_dies().pid if guard else None, seg.path))
    time.sleep(120)


def _start_owner(engine_id: str, guard: bool):
    parent, child_conn = CTX.Pipe()
    child = CTX.Process(target=_owner, args=(engine_id, guard, child_conn))
    child.start()
    assert parent.poll(60), "the owner did not start"
    return child, *parent.recv()


def test_a_guardian_never_removes_a_segment_another_owner_reattached(engine_id):
    """The guardian is stopped while its owner dies and a new owner re-attaches (warm
    restart); woken, it finds the segment owned by a live process and leaves it."""
    child, guardian, path = _start_owner(engine_id, guard=True)
    seg = None
    try:
        inode = os.stat(path).st_ino
        os.kill(guardian, signal.SIGSTOP)
        child.kill()
        child.join(10)
        seg = open_segment(engine_id, ArenaGeometry(4, 4096, 4096, 1), "fp", owner=True,
                           warm_restart=True)
        assert not seg.is_creator
        os.kill(guardian, signal.SIGCONT)
        deadline = time.monotonic() + GONE_WITHIN_S
        while _live([guardian]):
            assert time.monotonic() < deadline, "the woken guardian did not exit"
            time.sleep(0.01)
        assert os.stat(path).st_ino == inode  # the same object, still there
        assert seg.header().owner_pid == os.getpid()
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
        if _live([guardian]):
            os.kill(guardian, signal.SIGKILL)
        if seg is not None:
            seg.close()
        _unlink_ours(engine_id)


def test_remove_if_stale_waits_for_an_opener_holding_the_lock(engine_id):
    """``open_segment`` holds a segment's lock from its staleness check to its claim;
    meanwhile nothing removes it, afterwards a stale one goes."""
    child, _, path = _start_owner(engine_id, guard=False)
    try:
        name = segment_name(engine_id)
        assert remove_if_stale(name) is None  # its owner lives
        child.kill()
        child.join(10)
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # an opener between its check and its claim
            t0 = time.monotonic()
            assert remove_if_stale(name, lock_wait_s=0.2) is None
            assert time.monotonic() - t0 >= 0.2 and os.path.exists(path)
        finally:
            os.close(fd)
        removed = remove_if_stale(name)
        assert removed is not None and removed.name == name and not removed.alive
        assert not os.path.exists(path)
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
        _unlink_ours(engine_id)


_WAIT = """
import os, sys
from shmtier.shared import segment_guardian as g
owner = g._Owner(int(sys.argv[1]), int(sys.argv[2]))
if sys.argv[3] == "poll" and owner.pidfd is not None:
    os.close(owner.pidfd)
    owner.pidfd = None  # as where pidfd_open is refused
print("watching", owner.pidfd is not None, flush=True)
print("died" if g._wait(owner) else "bye", flush=True)
"""


@pytest.mark.parametrize("how", ["pidfd", "poll"])
@pytest.mark.parametrize("end", ["bye", "death"])
def test_the_guardian_wakes_on_bye_and_on_its_owners_death(how, end):
    """The guardian's wait, with a pidfd and polling: "bye" ends it as a clean shutdown,
    the owner's death as a death (a sleeping process stands in for the owner)."""
    import socket

    owner = subprocess.Popen(["sleep", "60"])
    mine, theirs = socket.socketpair()
    guard = subprocess.Popen([sys.executable, "-c", _WAIT, str(owner.pid),
                              str(procinfo.start_time(owner.pid)), how],
                             stdin=theirs.fileno(), stdout=subprocess.PIPE, text=True)
    theirs.close()
    try:
        assert guard.stdout.readline().split() == ["watching", str(how == "pidfd")]
        t0 = time.monotonic()
        if end == "bye":
            mine.send(b"bye\n")
        else:
            mine.close()  # end of file alone is no death: the owner still runs
            time.sleep(0.7)
            assert guard.poll() is None
            owner.kill()
            t0 = time.monotonic()
        assert guard.stdout.readline().strip() == ("bye" if end == "bye" else "died")
        assert time.monotonic() - t0 < 2.0
        assert guard.wait(10) == 0
    finally:
        for proc in (guard, owner):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        guard.stdout.close()
        mine.close()
