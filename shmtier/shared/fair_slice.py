"""A process's EEVDF time slice (Linux 6.12+ ``sched_setattr`` ``sched_runtime`` for fair tasks).

Why (bench/README.md, "Slowest steps"): on the EEVDF scheduler a task that got the CPU is
protected for its slice; a waking task preempts it at once only if the waker's slice is
*shorter* than the running task's (the kernel's ``PREEMPT_SHORT``), otherwise the wake-up
waits for the next tick (4 ms at HZ=250). Giving tier workers a slice longer than the
scheduler thread's (the kernel's base slice, ``sched_base_slice_ns``, 0.7-3 ms) lets the
scheduler thread preempt a worker as soon as it wakes, while the worker keeps its fair
share (niceness unchanged): unlike ``SCHED_IDLE`` it is never starved.

Called from: a tier worker process on itself at start-up (``workers/job_loop.py``), or a
bench on a worker's pid. Never blocks. Linux x86-64/aarch64 only; elsewhere, or on a
kernel without custom slices, ``set_fair_slice`` raises OSError and the caller decides.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

#: the kernel clamps a custom fair slice to this range (kernel/sched/syscalls.c)
MIN_SLICE_NS, MAX_SLICE_NS = 100_000, 100_000_000

_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}  # (sched_setattr, sched_getattr)
_ATTR = struct.Struct("IIQiIQQQ")  # struct sched_attr, SCHED_ATTR_SIZE_VER0 (48 bytes)
_libc = None


def _syscall(which: int, *args) -> None:
    global _libc
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(f"sched_setattr: no syscall number known for {platform.machine()}")
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.syscall(numbers[which], *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def fair_slice(pid: int = 0) -> int:
    """The fair-class slice of ``pid`` (0: the caller) in ns: its custom one, or the
    kernel's base slice. Raises OSError where the kernel does not report it."""
    buf = ctypes.create_string_buffer(56)
    _syscall(1, pid, buf, 56, 0)
    return _ATTR.unpack_from(buf.raw)[5]


def set_fair_slice(pid: int, slice_ns: int) -> None:
    """Give ``pid`` (0: the caller; only its main thread) a custom fair slice of
    ``slice_ns``, keeping its policy and niceness. ``slice_ns`` must lie in
    [MIN_SLICE_NS, MAX_SLICE_NS]. Raises OSError if the kernel refuses (older than 6.12:
    the value is not kept, checked by reading it back)."""
    if not MIN_SLICE_NS <= slice_ns <= MAX_SLICE_NS:
        raise ValueError(f"slice_ns: {slice_ns} is outside [{MIN_SLICE_NS}, {MAX_SLICE_NS}]")
    policy = os.sched_getscheduler(pid)
    if policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        raise OSError(f"sched_setattr: pid {pid} is not a fair-class task (policy {policy})")
    nice = os.getpriority(os.PRIO_PROCESS, pid)
    buf = ctypes.create_string_buffer(_ATTR.pack(_ATTR.size, policy, 0, nice, 0, slice_ns, 0, 0),
                                      _ATTR.size)
    _syscall(0, pid, buf, 0)
    if fair_slice(pid) != slice_ns:
        raise OSError(f"sched_setattr: this kernel ({platform.release()}) keeps no custom "
                      f"fair slice (needs Linux 6.12+)")
