"""The p2p tier's endpoint process as its scheduler half sees it: spawn, channel, backoff,
watchdog, reaping (:class:`EndpointSupervisor`).

Runs in: the scheduler process, called by the tier's scheduler half (``scheduler.py``)
under the tiering manager's lock, from the scheduler thread or the tier-poll thread;
never blocks, except ``wait_reaped`` and ``shutdown`` (bounded: ``REAP_WAIT_S``,
``STOP_WAIT_S``), which ``drain_jobs`` and ``shutdown`` call.

Spawn: ``python -m shmtier.tiers.p2p.endpoint`` (``shmtier/tiers/p2p/endpoint/``), its
settings as msgpack on stdin; the channel is a ZeroMQ PAIR socket on ``ipc://`` in a
socket directory of its own (``$TMPDIR/shmtier-p2p-<engine_id>-XXXX/``, where the
endpoint also writes its status file, ``status.py``; made, and removed when the engine is
killed, by ``socket_dirs.py``). A new socket for each endpoint.

Supervision, every ``CHECK_EVERY_S`` while one runs: an endpoint that ended is gone; the
tier's ``check`` (its watchdog: a load unanswered past its deadline) may name a reason
to kill it (SIGKILL, not waited for: a process in uninterruptible I/O may take long to
go), after which the rows it may still write are held until it is reaped (the release
event this module sets at the poll that finds it gone). Either way the tier's ``gone``
fails what the endpoint held and the next endpoint starts after a backoff (0.5 s
doubling to 30 s, back to 0.5 s once one ran ``STABLE_S``), and only once every killed
one is reaped.

Channel: the messages of ``channel.py`` (typed, versioned: an endpoint whose ``Ready``
names another channel version is killed and not restarted, with an ERROR naming both).
What a step queues goes as one frame at its end (an ipc send costs the
scheduler thread tens of µs) or, while the tier-poll thread polls the tier, at that
thread's next poll; else at a poll ``FLUSH_AFTER_S`` later. A poll looks at the socket at
most every ``READ_GAP_S`` (each look costs ~3 µs of the lock holder's time), except the
tier-poll thread's first poll after ``poll_fds`` (reading EVENTS is what clears the
edge-triggered FD it waits on).
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Callable

import msgpack

from shmtier.tiers.p2p import channel, socket_dirs

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.05
RESTART_BASE_S, RESTART_CAP_S, STABLE_S = 0.5, 30.0, 30.0
FLUSH_AFTER_S = 0.002  # messages queued this long go at the next poll, not only at step end
OFF_THREAD_SEEN_S = 0.05  # the tier-poll thread polled this recently: it sends a step's batch
# a poll this soon after the last look at the endpoint's socket (by either thread) does not
# look again: a step polls 4-5 times within a few hundred µs and a tier-poll round twice,
# and each look (getsockopt EVENTS) costs ~3 µs of the lock holder's time (bench/README.md)
READ_GAP_S = 0.0005
STOP_WAIT_S = 2.0
REAP_WAIT_S = 10.0  # drain_jobs waits this long at most for a killed endpoint to be gone
ENDPOINT_MODULE = "shmtier.tiers.p2p.endpoint"


class EndpointSupervisor:
    """One engine's p2p endpoint process and the channel to it.

    The tier gives: ``label`` (for logs), ``engine_id`` (names the socket directory, so
    ``status.py`` finds the endpoint's status file), ``settings(ipc, status_path)`` (the
    endpoint's settings, asked at each spawn), ``handle(msg)`` (each message the
    endpoint sends, a ``channel`` message, ``Ready`` included), ``check(now)`` (every
    ``CHECK_EVERY_S`` while an endpoint runs: a reason to kill it, or None) and
    ``gone(why, release)`` (the endpoint died or was killed: fail what it held, with
    ``release`` on the loads whose rows it may still write; returns what was failed, in
    words, for the log line).

    ``proc`` is None while no endpoint runs (restarting, or closed, or ``broken``: the
    reason no endpoint is started any more, an endpoint of another channel version);
    ``step_thread`` is the thread that runs the scheduler's steps (set by the tier at
    ``on_schedule_end``).
    """

    def __init__(self, label: str, engine_id: str, *, settings: Callable[[str, str], dict],
                 handle: Callable[[channel.ToScheduler], None],
                 check: Callable[[float], str | None],
                 gone: Callable[[str, threading.Event | None], str]) -> None:
        import zmq

        self._label = label
        self._settings, self._handle, self._check, self._gone = settings, handle, check, gone
        self._zmq = zmq
        # named after the engine: its endpoint's status file is found by it (status.py);
        # its owner file lets the guardian remove it if the engine is killed (socket_dirs.py)
        self.tmpdir = socket_dirs.make(engine_id)
        self._zctx = zmq.Context()
        self._sock = None
        self.proc: subprocess.Popen | None = None
        # killed endpoints not yet reaped, each with the release of its failed loads' rows
        self.reaping: list[tuple[subprocess.Popen, threading.Event | None]] = []
        self.restarts = 0
        self._gen = 0
        self._outbox: collections.deque = collections.deque()  # frames, to send
        self._pending: list[channel.ToEndpoint] = []  # queued this step: one frame at its end
        self._queued_at = 0.0
        self.step_thread = None  # the thread that calls on_schedule_end
        self._off_thread_at = -1.0  # when another thread (the tier-poll thread) last polled
        self._flush_due = False  # a step's batch waits for that thread to send it
        self._zmq_events = int(zmq.EVENTS)
        self._zmq_pollin = int(zmq.POLLIN)
        self.ready = False
        self._ready_at = 0.0
        self._backoff = RESTART_BASE_S
        self._restart_at = 0.0
        self._next_check = 0.0
        self._read_at = -1.0  # when a poll last looked at the socket
        self._sock_fd = -1  # the socket's zmq.FD (taken under the lock, when it is made)
        self._look_next = False  # the next off-thread poll looks at the socket (poll_fds)
        self.closed = False
        self.broken: str | None = None

    # ------------------------------------------------------------------ the process

    def start(self) -> None:
        """Spawn an endpoint on a new socket. Raises what binding the socket or spawning
        raises (the tier's constructor shuts down then); a process that dies at once is
        seen by the next check."""
        zmq = self._zmq
        self._gen += 1
        # (a generation's socket name comes back after 10,000: socket_dirs.LONGEST_SOCKET)
        path = os.path.join(self.tmpdir, f"ep{self._gen % 10_000}.sock")
        sock = self._zctx.socket(zmq.PAIR)
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = 0
        sock.bind(f"ipc://{path}")
        self._sock = sock
        self._sock_fd = sock.getsockopt(zmq.FD)
        from shmtier.tiers.p2p.status import STATUS_FILE

        settings = self._settings(f"ipc://{path}", os.path.join(self.tmpdir, STATUS_FILE))
        self.proc = subprocess.Popen([sys.executable, "-m", ENDPOINT_MODULE],
                                     stdin=subprocess.PIPE)
        try:
            self.proc.stdin.write(msgpack.packb(settings, use_bin_type=True))
            self.proc.stdin.close()
        except OSError:
            pass  # it died already: the next check restarts it
        self.ready = False
        self._next_check = time.monotonic() + CHECK_EVERY_S

    def _mark_ready(self) -> None:
        """The endpoint said ``Ready`` (it runs: its backoff resets once it ran STABLE_S)."""
        self.ready, self._ready_at = True, time.monotonic()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
            self._sock_fd = -1
        self._outbox.clear()
        self._pending = []

    def _died(self, why: str, release: threading.Event | None = None) -> None:
        code = self.proc.poll() if self.proc is not None else None
        if self.ready and time.monotonic() - self._ready_at > STABLE_S:
            self._backoff = RESTART_BASE_S  # it had been running well: restart soon
        self.proc = None
        self._close_socket()
        self.ready = False
        failed = self._gone(why, release)
        logger.error("p2p tier %s: endpoint process %s (%s); failing %s, %s", self._label,
                     f"exited with {code}" if code is not None else "killed", why, failed,
                     f"restarting in {self._backoff:.1f} s" if self.broken is None else
                     "not restarting it: the tier fetches and serves nothing until the "
                     "engine restarts with one shmtier version")
        self._restart_at = time.monotonic() + self._backoff
        self._backoff = min(RESTART_CAP_S, self._backoff * 2)
        self.restarts += 1

    def kill(self, why: str) -> None:
        """SIGKILL the endpoint without waiting for it: what it held fails now (``gone``),
        the loads' rows held until :meth:`poll` finds it reaped."""
        proc, release = self.proc, None
        if proc is not None:
            proc.kill()
            if proc.poll() is None:
                release = threading.Event()
                self.reaping.append((proc, release))
        self._died(why, release)

    def _reap(self) -> None:
        """Reap the killed endpoints that are gone and set their releases. Non-blocking."""
        left = []
        for proc, release in self.reaping:
            if proc.poll() is None:
                left.append((proc, release))
            elif release is not None:
                release.set()
        self.reaping = left

    def wait_reaped(self, what: str) -> None:
        """Block until every killed endpoint is reaped (at most REAP_WAIT_S each) and set
        their releases; RuntimeError if one is not gone by then."""
        while self.reaping:
            proc, release = self.reaping[0]
            try:
                proc.wait(REAP_WAIT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"p2p tier {self._label}: {what}: the endpoint process {proc.pid} was "
                    f"killed but is not gone after {REAP_WAIT_S:g} s; the primary rows its "
                    f"failed loads may still write stay held") from None
            if release is not None:
                release.set()
            self.reaping.pop(0)

    # ------------------------------------------------------------------ the channel

    def send(self, msg: channel.ToEndpoint) -> None:
        """Queue ``msg`` for the endpoint (sent as the module docstring says)."""
        if not self._pending:
            self._queued_at = time.monotonic()
        self._pending.append(msg)

    def flush(self) -> None:
        """Send what is queued now (what the endpoint's socket takes). Non-blocking."""
        self._flush_due = False
        sock, zmq = self._sock, self._zmq
        if self._pending and sock is not None:
            self._outbox.append(channel.encode(self._pending))
            self._pending = []
        while self._outbox and sock is not None:
            try:
                sock.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:  # no endpoint connected yet
                return
            self._outbox.popleft()

    def end_step(self) -> None:
        """The step's end: send what it queued, or leave it to the tier-poll thread when
        that thread polls the tier (then not on the scheduler thread)."""
        if time.monotonic() - self._off_thread_at < OFF_THREAD_SEEN_S:
            self._flush_due = bool(self._pending)
        else:
            self.flush()

    def flush_off_thread(self) -> None:
        """Send what is queued now when called off the step thread (answers made by the
        tier-poll thread go at once, not FLUSH_AFTER_S later)."""
        if self._pending and threading.get_ident() != self.step_thread:
            self.flush()

    def poll(self) -> None:
        """Supervise the endpoint and take what it sent (looking at the socket at most
        every READ_GAP_S); send what is due. Non-blocking."""
        if self.closed:
            return
        now = time.monotonic()
        off_thread = threading.get_ident() != self.step_thread
        if off_thread:
            self._off_thread_at = now
        if self.reaping:
            self._reap()
        if self.proc is None:
            if now >= self._restart_at and not self.reaping and self.broken is None:
                self.start()
            return
        if now >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            if self.proc.poll() is not None:
                self._died("its process ended")
                return
            why = self._check(now)
            if why is not None:
                self.kill(why)
                return
        zmq, sock = self._zmq, self._sock
        # ask first: a recv that raises zmq.Again costs ~20 µs, and this runs several
        # times a step, mostly with nothing to read (and at most every READ_GAP_S, except
        # the tier-poll thread's first poll after poll_fds: reading EVENTS is what clears
        # the edge-triggered FD it waits on, and news may have woken it)
        if now - self._read_at >= READ_GAP_S or (off_thread and self._look_next):
            self._read_at = now
            if off_thread:
                self._look_next = False
            while sock.getsockopt(self._zmq_events) & self._zmq_pollin:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    messages = channel.from_endpoint(frame)
                except channel.VersionMismatch as e:
                    self.broken = str(e)
                    self.kill(self.broken)
                    return
                for msg in messages:
                    if type(msg) is channel.Ready:
                        self._mark_ready()
                    self._handle(msg)
        if (self._outbox or (self._flush_due and off_thread)
                or (self._pending and now - self._queued_at >= FLUSH_AFTER_S)):
            self.flush()

    def poll_fds(self) -> tuple[int, ...]:
        """The endpoint socket's FD, none while there is no socket; the next off-thread
        poll looks at the socket (READ_GAP_S does not apply)."""
        if self.closed or self._sock_fd < 0:
            return ()
        self._look_next = True
        return (self._sock_fd,)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the endpoint (``stop``, then SIGKILL after STOP_WAIT_S), wait for the
        killed ones (an ERROR past REAP_WAIT_S: nothing reuses the rows any more), close
        the channel and remove the socket directory. Blocks up to those bounds."""
        if self.closed:
            return
        if self.proc is not None and self._sock is not None:
            try:
                self.send(channel.Stop())
                self.flush()
            except Exception:
                pass
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        elif self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        try:
            self.wait_reaped("shutdown")
        except RuntimeError as e:  # shutting down: nothing reuses the rows any more
            logger.error("%s", e)
            self.reaping = []
        self.closed = True
        self.proc = None
        self._close_socket()
        self._zctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
