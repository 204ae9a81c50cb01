"""The segment guardian: removes an engine's segment and its ring semaphores when the
process that owns the segment dies without closing it.

Runs in: its own small process (``python -m shmtier.shared.segment_guardian``), one per
segment whose owner does not keep it for a warm restart. The owner starts it
(``Segment.remove_when_owner_dies``; the spec's ``get_manager`` does so when
``warm_restart`` is off) through :meth:`Guardian.start`, and lets it go with
:meth:`Guardian.release` when it closes the segment. Imports neither torch nor vLLM,
and nothing of shmtier but ``procinfo`` until its owner is gone.

::

    owner (scheduler process)                      guardian
    Guardian.start: Popen(python -m ... NAME INODE OWNER_PID OWNER_START,
                          new session)  ─────────▶ fork; the first process exits (the
                                                   owner reaps it), so the guardian is
                                                   not the owner's descendant any more
                                                   pidfd_open(owner), start time checked
    reads "ready PID" (≤ 10 s) ◀──────── stdout ──
    ... the engine runs; the guardian sleeps in poll(): nothing per step ...
    Segment.close(): unlinks, then "bye" ─ stdin ▶ exits 0, touching nothing
    owner dies (SIGKILL, OOM, a crash) ──────────▶ pidfd readable: remove_if_stale(NAME,
                                                   INODE) and clean_stale_ring_semaphores
                                                   ({NAME}); each tier type lets go of
                                                   what it keeps for the engine (its
                                                   registry tool's engine_died: the node
                                                   tier's pools), WARNINGs, exits 0

Why a process of its own, outside the owner's process tree: vLLM stops an EngineCore
that does not exit at once (its default ``--shutdown-timeout 0``) by SIGKILLing it
*and every process descended from it*. The tier workers the pool spawns are among
them, so they cannot be the ones to clean up (and an engine without a secondary tier
has no workers at all); a guardian that is its owner's child would be killed too. Hence
the double fork (a process reparented to init, or to the nearest subreaper) in a
session of its own, which neither that kill nor a terminal's Ctrl-C reaches. It
ignores SIGTERM, SIGINT and SIGHUP: a service manager that signals every process of the
service at stop must not end it before its owner is gone; it ends with its owner.

Why a pidfd: it wakes the guardian when the owner exits, with no polling; a kernel or
sandbox that refuses ``pidfd_open`` gets a poll of the owner's identity every 0.5 s
instead. The socket on stdin carries the clean shutdown ("bye"); its end of file alone
proves nothing (a fork of the owner may hold the other end), so death is judged by
the pidfd and the owner's identity only.

What it removes, and when not: the one staleness rule of ``segment.py``
(``remove_if_stale``: owner pid + start time + boot id, under the segment's lock,
which ``open_segment`` holds from its staleness check to its claim), so a segment that
another owner re-attached to, or a newer segment of the same name, is never removed;
the ring semaphores by ``clean_stale_ring_semaphores``, the same rule. GPU worker
processes may still map the segment for a moment: an unlinked name's memory stays
mapped where it is mapped, and is freed when the last mapping goes.

Modes: with ``warm_restart`` no guardian starts: the segment stays for the next owner.
With external tier workers (``workers: "external"``, ``shmtier workers``) the guardian
does the same as in spawn mode: ``shmtier workers`` exits when the owner dies (it
always did) and holds no names, and an engine restarted without ``warm_restart``
replaces a stale segment anyway, so keeping it would serve nobody.

Costs: one Python start-up when the engine starts (``get_manager`` waits for "ready"),
one idle interpreter (about 10 MB resident) while it runs; numpy is imported only to
clean up. A guardian that cannot start is a WARNING, not an error: the engine runs,
and a crash then needs ``shmtier clean``. A guardian killed itself (SIGKILL) leaves
the same to ``shmtier clean``. Where PID 1 does not reap orphans (a container started
without an init), an exited guardian stays a zombie, holding no memory, until the
container ends.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time

from shmtier.shared import procinfo
from shmtier.shared.log_setup import configure_logging

MODULE = "shmtier.shared.segment_guardian"
logger = logging.getLogger(MODULE)  # the same name when run as __main__
_START_TIMEOUT_S = 10.0
_POLL_WITHOUT_PIDFD_S = 0.5
_LOCK_WAIT_S = 10.0  # an opener holds the segment's lock for microseconds
_BYE = b"bye\n"


class Guardian:
    """The owner's handle of a running guardian (scheduler process): its ``pid`` and
    :meth:`release`."""

    def __init__(self, pid: int, bye: socket.socket, segment_name: str):
        self.pid = pid
        self.segment_name = segment_name
        self._bye: socket.socket | None = bye
        self._started_by = os.getpid()  # a fork of the owner never releases it

    @classmethod
    def start(cls, segment_name: str, inode: int,
              timeout_s: float = _START_TIMEOUT_S) -> "Guardian | None":
        """Start the guardian of segment ``segment_name`` (the object ``inode``) for the
        calling process, its owner; blocks until it is watching (one Python start-up;
        at most ``timeout_s``). None, with one WARNING naming why, when it cannot start."""
        pid, started = procinfo.me()
        # stdin is a socket, so that "bye" to a guardian already gone is an error
        # (MSG_NOSIGNAL), never a SIGPIPE, whatever this process does with that signal
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", MODULE, segment_name, str(inode), str(pid),
                     str(started)],
                    stdin=theirs.fileno(), stdout=subprocess.PIPE, start_new_session=True)
            finally:
                theirs.close()
        except OSError as e:
            mine.close()
            logger.warning("segment %s: cannot start its guardian (%s); if this process dies "
                           "without closing it, `shmtier clean` removes it", segment_name, e)
            return None
        try:
            line = _read_line(proc.stdout.fileno(), timeout_s)
        finally:
            proc.stdout.close()
        try:
            code = proc.wait(timeout_s)  # the first process exits right after its fork
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        words = line.split()
        if code != 0 or len(words) != 2 or words[0] != b"ready" or not words[1].isdigit():
            mine.close()
            logger.warning("segment %s: its guardian did not start (exit code %s, said %r); "
                           "if this process dies without closing it, `shmtier clean` removes "
                           "it", segment_name, code, line.decode(errors="replace")[:200])
            return None
        guardian = cls(int(words[1]), mine, segment_name)
        logger.info("segment %s: guardian pid %d removes it if this process (pid %d) dies "
                    "without closing it", segment_name, guardian.pid, pid)
        return guardian

    def release(self) -> None:
        """The owner closed the segment: the guardian exits without touching anything.
        Idempotent; never blocks (a guardian already gone is fine)."""
        sock, self._bye = self._bye, None
        if sock is None:
            return
        try:
            if os.getpid() == self._started_by:
                sock.send(_BYE, socket.MSG_NOSIGNAL)
        except OSError:
            pass
        finally:
            sock.close()


def _read_line(fd: int, timeout_s: float) -> bytes:
    """One line from pipe ``fd``, waiting at most ``timeout_s``; what came on end of file
    or timeout."""
    deadline = time.monotonic() + timeout_s
    got = b""
    while b"\n" not in got:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 256)
        if not chunk:
            break
        got += chunk
    return got.split(b"\n", 1)[0]


def guardian_pids(segment_name: str) -> list[int]:
    """Pids of the running (not zombie) guardians of ``segment_name`` (tests, tools)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if MODULE.encode() in argv and segment_name.encode() in argv:
            start = procinfo.start_time(int(entry))
            if start is not None and procinfo.is_alive(int(entry), start, procinfo.boot_id()):
                found.append(int(entry))
    return found


# --- the guardian process ---


class _Owner:
    """The owner's identity and a way to wait for its death."""

    def __init__(self, pid: int, started: int):
        self.pid, self.started, self.boot = pid, started, procinfo.boot_id()
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            pass  # gone already (checked below), or refused: poll instead
        if self.pidfd is not None and not self.alive():
            os.close(self.pidfd)  # it may name a newer process with the owner's pid
            self.pidfd = None

    def alive(self) -> bool:
        return procinfo.is_alive(self.pid, self.started, self.boot)


def _wait(owner: _Owner) -> bool:
    """Sleep until the owner says "bye" (False) or dies (True)."""
    poller = select.poll()
    poller.register(0, select.POLLIN)
    if owner.pidfd is not None:
        poller.register(owner.pidfd, select.POLLIN)
    timeout_ms = None if owner.pidfd is not None else int(_POLL_WITHOUT_PIDFD_S * 1000)
    while owner.pidfd is not None or owner.alive():
        for fd, _ in poller.poll(timeout_ms):
            if fd == owner.pidfd:
                return True
            data = os.read(0, 64)
            if _BYE.strip() in data:
                return False
            if not data:
                poller.unregister(0)  # end of file: death is judged by the pidfd alone
    return True


def _tiers_of(name: str) -> list:
    """The dead engine's tiers as its segment names them (read before it is removed)."""
    from shmtier.shared.snapshot import snapshot

    try:
        return snapshot(name, rows=False).tiers
    except (OSError, ValueError):
        return []


def _tiers_left(tiers: list) -> list[str]:
    """What each tier type keeps on the host for the dead engine, let go
    (``TierFsck.engine_died``: the node tier's pools); its log lines."""
    from shmtier.tiers import registry

    lines = []
    for tool in registry.fsck_tools():
        try:
            lines += tool.engine_died(tiers)
        except Exception as e:  # one tier's failure leaves the others' cleanup
            lines.append(f"{tool.tier_type} tier: {type(e).__name__}: {e}")
    return lines


def _clean(name: str, inode: int, owner: _Owner, died_at: float) -> None:
    from shmtier.shared.ring_tools import clean_stale_ring_semaphores
    from shmtier.shared.segment import human_bytes
    from shmtier.shared.segment_tools import list_segments, remove_if_stale

    tiers = _tiers_of(name)
    removed = remove_if_stale(name, inode=inode, lock_wait_s=_LOCK_WAIT_S)
    sems = clean_stale_ring_semaphores({name})
    for line in _tiers_left(tiers):
        logger.warning("segment %s: %s", name, line)
    took = time.monotonic() - died_at
    if removed is not None:
        logger.warning("segment %s (%s): its owner, pid %d, died without closing it; removed "
                       "it and %d ring semaphores in %.2f s (warm_restart is off)", name,
                       human_bytes(removed.size), owner.pid, len(sems), took)
        return
    now = [s for s in list_segments() if s.name == name and s.alive]
    left = (f"held by live pid {now[0].owner_pid or now[0].creator_pid} now (an engine "
            f"restarted on it): left in place" if now else "already gone")
    logger.warning("segment %s: its owner, pid %d, died without closing it; the name is %s; "
                   "removed %d stale ring semaphores", name, owner.pid, left, len(sems))


def main(argv: list[str] | None = None) -> int:
    """``main([segment_name, inode, owner_pid, owner_start_time])``: guard until the
    owner says "bye" or dies (see the module docstring); exit code 0 either way."""
    name, inode, pid, started = (sys.argv[1:] if argv is None else argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if os.fork():
        os._exit(0)  # leave the owner's process tree: the owner reaps this first process
    os.chdir("/")
    configure_logging("segment-guardian")
    owner = _Owner(int(pid), int(started))
    os.write(1, f"ready {os.getpid()}\n".encode())
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # the owner's pipe ends here: it reads no more than that line
    os.close(null)
    if _wait(owner):
        _clean(name, int(inode), owner, time.monotonic())
    return 0


if __name__ == "__main__":
    sys.exit(main())
