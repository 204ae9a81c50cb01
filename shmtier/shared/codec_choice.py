"""Compression by cost: whether a tier worker compresses the next chunks of a tier
(codec mode ``"auto"``), from measured rates (issue 14 item 3).

Runs in: tier worker processes (a storage backend's write path asks its
:class:`CodecChooser` once per store slice), and tests. No I/O but one read of
``/proc/stat`` at most every ``_HOST_EVERY_S``; never blocks.

The rule is :func:`choose` -- a pure function of :class:`CostInputs`, one test per rule in
``tests/test_codec_choice.py``. Per raw byte of a chunk, with ``r`` the measured ratio
(raw / stored of compressed frames), ``C`` the encoder's CPU seconds per byte compressed,
``K`` per byte framed raw (its CRC), ``w`` the tier's write CPU seconds per stored byte
in this process (kernel copy, syscalls, the client's work) and ``W`` its write wall
seconds per stored byte (device or link included)::

    CPU  raw: K + w              compressed: C + w / r
    wait raw: W - w              compressed: (W - w) / r     (device / link time)
    worker seconds per byte  T = wait + CPU / share

CPU figures are the thread's CPU time (``time.thread_time``); the write's wait is its
wall time less its CPU and less the time the thread sat runnable in the run queue
(``/proc/thread-self/schedstat``), so a busy host's scheduling delays are not taken for
a slow device. ``share``: the CPU share the worker gets while it wants to run (its run
time over run + run-queue time, from ``schedstat``; where that cannot be read, the
host's idle cores plus the worker's own use, at most 1), at least 0.05. In order:

1. ``incompressible``: ``r`` below what ``min_gain`` asks -> raw (the encoder would store
   raw frames anyway, after paying for the attempt).
2. ``unmeasured``: no rates yet -> compress, or raw while the worker is behind (the
   behaviour before: ``_HURRY_BYTES`` of store work held).
3. ``keeping up``: the worker is not behind and the host has ``idle_cores >=
   busy_idle_cores`` -> compress: there is CPU to spare and the bytes saved on the tier
   are capacity (hit rate) and bandwidth.
4. otherwise (behind, or a busy host) ``faster``: the option with the smaller ``T`` --
   compressed when ``T_z <= T_raw * (1 + prefer_compress)`` (a tie saves bytes). A fast
   local disk (``W ~ w``, page-cache copies) on a busy host goes raw; a slow network tier
   (``W >> w``) compresses, since the link's time shrinks by ``r`` for less CPU than it
   saves.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Host CPU sampled at most this often (one read of /proc/stat and a getrusage).
_HOST_EVERY_S = 0.5
#: Weight of a new sample in the rates' moving averages.
_ALPHA = 0.2
#: While storing raw by choice, every this many chunks is compressed all the same, to
#: keep the codec's rates and the ratio measured (so the choice can turn back).
PROBE_EVERY = 32
#: Seconds between two INFO lines of one chooser (a flapping choice logs once per).
_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class CostInputs:
    """What :func:`choose` decides from. Seconds are per byte; None = not measured yet.

    ``compress_s``: encoder CPU s per raw byte compressed (split + zstd + CRCs);
    ``raw_s``: per raw byte framed raw (CRC); ``ratio``: raw / stored of compressed
    frames; ``write_cpu_s`` and ``write_wall_s``: the tier's write per stored byte, CPU of
    this thread and wall less run-queue time; ``idle_cores``: idle cores of the host;
    ``share``: the CPU share (0..1) the worker gets while it wants to run;
    ``behind``: the worker holds more store work than ``_HURRY_BYTES``;
    ``min_gain``: the codec config's; ``busy_idle_cores``: idle cores below which the
    host counts as busy; ``prefer_compress``: the margin by which compressing may be
    slower and still be chosen.
    """

    compress_s: float | None
    raw_s: float | None
    ratio: float | None
    write_cpu_s: float | None
    write_wall_s: float | None
    idle_cores: float
    share: float
    behind: bool
    min_gain: float = 0.05
    busy_idle_cores: float = 0.5
    prefer_compress: float = 0.1


@dataclass(frozen=True)
class Decision:
    """``compress``: whether to compress; ``reason``: the rule that decided
    (``incompressible``, ``unmeasured``, ``keeping up``, ``faster``); ``t_raw`` and
    ``t_compressed``: worker seconds per raw byte of each option (None when not
    computed)."""

    compress: bool
    reason: str
    t_raw: float | None = None
    t_compressed: float | None = None


def worker_seconds(i: CostInputs) -> tuple[float, float]:
    """``(T_raw, T_compressed)``: worker seconds per raw byte of each option (module
    docstring). Needs every rate measured."""
    r = i.ratio
    share = min(1.0, max(0.05, i.share))
    wait = max(0.0, i.write_wall_s - i.write_cpu_s)
    t_raw = wait + ((i.raw_s or 0.0) + i.write_cpu_s) / share
    t_z = wait / r + (i.compress_s + i.write_cpu_s / r) / share
    return t_raw, t_z


def choose(i: CostInputs) -> Decision:
    """Compress the next chunks or store them raw (module docstring, rules 1-4)."""
    if i.ratio is not None and i.ratio * (1.0 - i.min_gain) < 1.0:
        return Decision(False, "incompressible")
    if None in (i.compress_s, i.ratio, i.write_cpu_s, i.write_wall_s):
        return Decision(not i.behind, "unmeasured")
    t_raw, t_z = worker_seconds(i)
    if not i.behind and i.idle_cores >= i.busy_idle_cores:
        return Decision(True, "keeping up", t_raw, t_z)
    return Decision(t_z <= t_raw * (1.0 + i.prefer_compress), "faster", t_raw, t_z)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + _ALPHA * (new - old)


def _schedstat(fd: int | None) -> tuple[int, int] | None:
    """(run ns, run-queue wait ns) of a thread from its open ``schedstat`` file."""
    if fd is None:
        return None
    try:
        f = os.pread(fd, 64, 0).split()
        return int(f[0]), int(f[1])
    except (OSError, ValueError, IndexError):
        return None


def _open_schedstat(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


class HostCpu:
    """Idle cores of the host (``/proc/stat``) and the CPU share this process's main
    thread gets while it wants to run (``/proc/self/schedstat``: run time over run +
    run-queue time), from deltas between samples at least ``_HOST_EVERY_S`` apart (the
    first 0.05 s after construction). Where ``/proc/stat`` cannot be read the host counts
    as idle; where ``schedstat`` cannot, the share is idle cores + own use, at most 1."""

    def __init__(self) -> None:
        self.idle_cores = float(os.cpu_count() or 1)
        self.share = 1.0
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._sched_fd = _open_schedstat("/proc/self/schedstat")
        self._last = self._sample()
        self._every = 0.05  # the first sample soon, then every _HOST_EVERY_S

    def _sample(self) -> tuple:
        idle = None
        try:
            with open("/proc/stat", "rb") as f:
                fields = f.readline().split()
            idle = float(int(fields[4]) + int(fields[5]))  # idle + iowait, in ticks
        except (OSError, ValueError, IndexError):
            pass
        return time.monotonic(), idle, time.process_time(), _schedstat(self._sched_fd)

    def update(self) -> None:
        now = time.monotonic()
        if now - self._last[0] < self._every:
            return
        self._every = _HOST_EVERY_S
        t, idle, own, sched = self._sample()
        t0, idle0, own0, sched0 = self._last
        self._last = (t, idle, own, sched)
        dt = t - t0
        if dt <= 0:
            return
        if idle is not None and idle0 is not None:
            self.idle_cores = max(0.0, (idle - idle0) / self._tick / dt)
        if sched is not None and sched0 is not None:
            run, wait = sched[0] - sched0[0], sched[1] - sched0[1]
            if run + wait > 5_000_000:  # it wanted to run for 5 ms at least: a figure
                self.share = run / (run + wait)
        else:
            self.share = min(1.0, self.idle_cores + max(0.0, (own - own0) / dt))


_host: HostCpu | None = None
_host_lock = threading.Lock()
_threads = threading.local()  # per thread: its open schedstat file (one per thread, kept)


def _process_host() -> HostCpu:
    """The process's one :class:`HostCpu` (every chooser of the process shares it, and
    its one open descriptor)."""
    global _host
    with _host_lock:
        if _host is None:
            _host = HostCpu()
        return _host


def _thread_schedstat_fd() -> int | None:
    fd = getattr(_threads, "fd", -1)
    if fd == -1:
        fd = _threads.fd = _open_schedstat("/proc/thread-self/schedstat")
    return fd


class CodecChooser:
    """Measures a tier's rates in one worker and applies :func:`choose` (mode "auto").

    The write path calls :meth:`compress_next` before encoding a chunk, :meth:`clock`
    before the encode and before the write, and :meth:`note_encode` and
    :meth:`note_write` after each with that clock (per thread: the obj backend's I/O
    threads each keep theirs). ``decision`` and ``inputs`` are the last ones (exported
    as ``ResultFlag.COMPRESSION_OFF`` on store answers and one INFO line per change).
    ``tier``: a name for the log line.
    """

    def __init__(self, tier: str, min_gain: float, *, host: HostCpu | None = None) -> None:
        self.tier = tier
        self.min_gain = min_gain
        self.host = host if host is not None else _process_host()
        self.compress_s: float | None = None
        self.raw_s: float | None = None
        self.ratio: float | None = None
        self.write_cpu_s: float | None = None
        self.write_wall_s: float | None = None
        self.decision: Decision | None = None
        self.inputs: CostInputs | None = None
        self.changes = 0
        self._raw_run = 0
        _thread_schedstat_fd()  # the constructing thread's (the fs worker's only one) now
        self._logged: bool | None = None  # the choice the last INFO line announced
        self._logged_at = -_LOG_EVERY_S

    def compress_next(self, behind: bool) -> bool:
        """Whether to compress the next chunk (a raw choice is probed now and then)."""
        self.host.update()
        i = CostInputs(self.compress_s, self.raw_s, self.ratio, self.write_cpu_s,
                       self.write_wall_s, self.host.idle_cores, self.host.share, behind,
                       self.min_gain)
        d = choose(i)
        self.inputs = i
        old = self.decision
        self.decision = d
        if old is not None and old.compress != d.compress:
            self.changes += 1
        if d.compress != self._logged and d.reason != "unmeasured":
            self._log(d, i)
        if d.compress:
            self._raw_run = 0
            return True
        self._raw_run += 1
        return self._raw_run % PROBE_EVERY == 0  # a probe keeps the rates measured

    def clock(self) -> tuple:
        """Now, for :meth:`note_encode` / :meth:`note_write`: (wall, thread CPU, the
        thread's run-queue ns or None)."""
        st = _schedstat(_thread_schedstat_fd())
        return time.perf_counter(), time.thread_time(), None if st is None else st[1]

    def _spent(self, since: tuple) -> tuple[float, float]:
        """(thread CPU s, wall s less run-queue time) since ``since``."""
        now = self.clock()
        cpu = now[1] - since[1]
        wall = now[0] - since[0]
        if now[2] is not None and since[2] is not None:
            wall -= (now[2] - since[2]) / 1e9
        return cpu, max(wall, cpu)

    def note_encode(self, compressed_attempt: bool, raw_bytes: int, stored_bytes: int,
                    since: tuple) -> None:
        """One encode of ``raw_bytes`` into a frame of ``stored_bytes``, begun at
        ``since`` (:meth:`clock`); a compressed attempt (whatever codec it ended with)
        measures the codec and the ratio, a raw frame the CRC."""
        self.add_encode(compressed_attempt, raw_bytes, stored_bytes, self._spent(since)[0])

    def add_encode(self, compressed_attempt: bool, raw_bytes: int, stored_bytes: int,
                   cpu: float) -> None:
        """:meth:`note_encode` with the encode's CPU seconds given."""
        if raw_bytes <= 0:
            return
        if compressed_attempt:
            self.compress_s = _ema(self.compress_s, cpu / raw_bytes)
            self.ratio = _ema(self.ratio, raw_bytes / max(1, stored_bytes))
        else:
            self.raw_s = _ema(self.raw_s, cpu / raw_bytes)

    def note_write(self, stored_bytes: int, since: tuple) -> None:
        """One write of ``stored_bytes`` to the tier, begun at ``since``."""
        self.add_write(stored_bytes, *self._spent(since))

    def add_write(self, stored_bytes: int, cpu: float, wall: float) -> None:
        """:meth:`note_write` with the write's CPU and wall (less run-queue) seconds."""
        if stored_bytes <= 0:
            return
        self.write_cpu_s = _ema(self.write_cpu_s, cpu / stored_bytes)
        self.write_wall_s = _ema(self.write_wall_s, wall / stored_bytes)

    def _log(self, d: Decision, i: CostInputs) -> None:
        now = time.monotonic()
        if now - self._logged_at < _LOG_EVERY_S:
            return  # flapping: the line after the pause tells where it settled
        self._logged_at, self._logged = now, d.compress

        def gbps(s):
            return "?" if not s else f"{1e-9 / s:.2f}"

        logger.info(
            "tier %s: compression %s (%s): codec %s GB/s per core, ratio %s, write %s GB/s "
            "(CPU %s GB/s), host idle %.2f cores, CPU share %.2f, behind %s; worker s/GB "
            "raw %s compressed %s", self.tier, "on" if d.compress else "off", d.reason,
            gbps(i.compress_s), "?" if i.ratio is None else f"{i.ratio:.2f}",
            gbps(i.write_wall_s), gbps(i.write_cpu_s), i.idle_cores, i.share, i.behind,
            "?" if d.t_raw is None else f"{d.t_raw * 1e9:.2f}",
            "?" if d.t_compressed is None else f"{d.t_compressed * 1e9:.2f}")
