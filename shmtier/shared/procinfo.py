"""Process identity that survives pid reuse: (pid, start time, boot id); and which running
processes are an engine's tier workers (read from /proc; any process may call these)."""

from __future__ import annotations

import os
import uuid

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> bytes:
    """16 bytes identifying this boot of the machine (zeros if unknown)."""
    try:
        with open(_BOOT_ID_PATH) as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])  # field 22 of stat(5); fields[0] is field 3


def is_alive(pid: int, started: int, boot: bytes) -> bool:
    """True if the process recorded as (pid, started, boot) is still running."""
    if pid <= 0 or boot != boot_id():
        return False
    now = start_time(pid)
    if now is None or now != started:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")  # a zombie holds no mapping any more


def me() -> tuple[int, int]:
    """(pid, start time) of the calling process."""
    pid = os.getpid()
    return pid, start_time(pid) or 0


def is_tier_worker(pid: int, engine_id: str) -> bool:
    """Whether ``pid`` runs a tier worker of ``engine_id`` (its command line says so)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"shmtier.workers.job_loop" in argv and engine_id.encode() in argv


def tier_worker_pids(engine_id: str) -> list[int]:
    """Pids of the running tier workers of ``engine_id``."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and is_tier_worker(int(e), engine_id)]


def runnable_threads(pid: int) -> int | None:
    """How many threads of ``pid`` are running or waiting in a run queue for a CPU now
    (state R in ``/proc/PID/task/*/stat``); a thread blocked in a read, on a lock, or
    stopped by a signal is not. None where it cannot be read (the process is gone).
    One directory listing and one small read per thread; never blocks. (The kernel
    adds run-queue time to ``schedstat`` only once a thread runs again, so a thread
    starved of CPU is seen here, by its state, and not there.)"""
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    runnable, read = 0, 0
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # a thread that just ended
        runnable += state == b"R"
        read += 1
    return runnable if read else None
