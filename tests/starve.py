"""A busy host for tests: processes starved of CPU without being stopped.

``starved(pids)`` puts every thread of ``pids`` on one core under SCHED_IDLE (threads
they make later inherit both) and runs a busy loop pinned to that core at normal
priority, until the block ends. The processes keep running or waiting to run (state R)
and get next to no CPU, as tier workers (nice 10, SCHED_BATCH) do on a host whose cores
are all busy. The caller keeps the other cores. Shared by test_pool.py and
test_tiering_fs.py."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest

_HOG = """import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
end = time.monotonic() + 120  # a bound should the test process die without killing it
print("spinning", flush=True)
while time.monotonic() < end:
    pass
"""


@contextmanager
def starved(pids: list[int]):
    """Starve ``pids`` of CPU until the block ends (see the module docstring). Skips the
    test where fewer than 2 CPUs are usable. The processes stay SCHED_IDLE on that core
    afterwards, alone there."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: one to starve the workers on, one for the test")
    core = max(cpus)
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {core})
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    hog = subprocess.Popen([sys.executable, "-c", _HOG, str(core)], stdout=subprocess.PIPE,
                           text=True)
    try:
        assert hog.stdout.readline() == "spinning\n"
        yield
    finally:
        hog.kill()
        hog.wait(5)
        hog.stdout.close()
