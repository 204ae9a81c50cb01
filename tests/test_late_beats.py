"""The late-heartbeat judge (``shmtier/scheduler/pool/late_beats.py``) against real
processes: one blocked in a sleep, one stopped, one computing, one gone; the checks come
at the pool's health-check rhythm with the ages a late beat would have."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from shmtier.scheduler.pool.late_beats import LateBeats
from shmtier.shared.procinfo import runnable_threads

TIMEOUT = 0.4
CHECK = 0.05  # the pool's health-check period


@pytest.fixture
def child():
    made = []

    def start(code: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", code])
        made.append(p)
        time.sleep(0.3)  # past the interpreter's start
        return p

    yield start
    for p in made:
        p.kill()
        p.wait(5)


def _checks(judge: LateBeats, pid: int, until_age: float) -> float | None:
    """Health checks every CHECK s from a beat just made until ``until_age``; the age at
    which the judge said hung (None: never). Hung comes at the first check past the
    timeout on an idle host; a busy one delays the checks themselves."""
    t0 = time.monotonic()
    while (age := time.monotonic() - t0) < until_age:
        if judge.hung(0, pid, 12345, age, time.monotonic(), TIMEOUT):
            return age
        time.sleep(CHECK)
    return None


def test_a_blocked_or_stopped_worker_is_hung_at_the_timeout_as_before(child):
    sleeper = child("import time\ntime.sleep(60)")
    assert runnable_threads(sleeper.pid) == 0
    age = _checks(LateBeats(), sleeper.pid, 3 * TIMEOUT)
    assert age is not None and age > TIMEOUT, age  # within 3 timeouts

    spinner = child("while True: pass")
    spinner.send_signal(signal.SIGSTOP)
    time.sleep(0.05)
    assert runnable_threads(spinner.pid) == 0
    age = _checks(LateBeats(), spinner.pid, 3 * TIMEOUT)
    assert age is not None and age > TIMEOUT, age  # within 3 timeouts


def test_a_computing_worker_is_slow_not_hung_and_said_so_once(child, caplog):
    spinner = child("while True: pass")
    judge = LateBeats()
    assert _checks(judge, spinner.pid, 4 * TIMEOUT) is None
    assert judge.spared_total >= 3  # a verdict per window of TIMEOUT / 2, past the timeout
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"tier worker 0 (pid {spinner.pid}): no heartbeat for" in lines[0]
    assert "slow (a busy host), not hung" in lines[0]
    # a beat in time ends the window: sampling starts over at the next late beat
    assert not judge.hung(0, spinner.pid, 12345, 0.01, time.monotonic(), TIMEOUT)
    assert judge._windows == {}


def test_a_worker_that_cannot_be_read_is_hung_at_the_timeout(child):
    gone = child("pass")
    gone.wait(5)
    assert runnable_threads(gone.pid) is None
    age = _checks(LateBeats(), gone.pid, 3 * TIMEOUT)
    assert age is not None and age > TIMEOUT, age  # within 3 timeouts
