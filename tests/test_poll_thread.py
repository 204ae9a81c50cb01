"""The tier-poll thread's fd wake-ups (shmtier/scheduler/tiering/poll_thread.py): real
threads, a real lock and real pipes; no tier manager (test_tiering_manager.py covers
the manager starting and stopping it)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from shmtier.scheduler.tiering.poll_thread import TierPollThread


class FdTier:
    """Stands in for a polled tier: ``poll_fds`` gives a real pipe's read end; a round
    drains it only when ``drain`` is set. Records where each call ran."""

    def __init__(self, lock: threading.Lock, drain: bool = True):
        self.lock = lock
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.drain = drain
        self.rounds: list[float] = []
        self.unlocked_calls = 0
        self.fds_calls = 0

    def poll(self) -> None:
        self.unlocked_calls += not self.lock.locked()
        self.rounds.append(time.monotonic())
        if self.drain:
            try:
                os.read(self.r, 4096)
            except BlockingIOError:
                pass

    def poll_fds(self) -> tuple[int, ...]:
        self.unlocked_calls += not self.lock.locked()
        self.fds_calls += 1
        return (self.r,)

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


@pytest.fixture
def fd_tier():
    tiers = []

    def make(**kw):
        tier = FdTier(threading.Lock(), **kw)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def started(tier: FdTier, interval_s: float) -> TierPollThread:
    thread = TierPollThread(tier.lock, tier.poll, interval_s, [tier])
    deadline = time.monotonic() + 5
    while tier.fds_calls == 0:  # its first round is over: it waits on the pipe now
        assert time.monotonic() < deadline, "no first round"
        time.sleep(0.001)
    return thread


def test_a_readable_fd_wakes_a_round_long_before_the_interval(fd_tier):
    tier = fd_tier()
    thread = started(tier, 2.0)
    try:
        time.sleep(0.05)
        n = len(tier.rounds)
        sent = time.monotonic()
        os.write(tier.w, b"x")
        deadline = sent + 1.0
        while len(tier.rounds) == n:
            assert time.monotonic() < deadline, "the fd did not wake a round"
            time.sleep(0.0005)
        assert tier.rounds[-1] - sent < 0.5
        assert thread.woken_rounds == 1
        assert tier.unlocked_calls == 0  # poll and poll_fds ran under the lock
    finally:
        assert thread.stop()


def test_news_after_a_woken_round_wakes_the_next_at_once(fd_tier):
    tier = fd_tier()
    thread = started(tier, 2.0)
    try:
        for n in (2, 3):  # two pieces of news, 50 ms apart, each woken at once
            time.sleep(0.05)
            sent = time.monotonic()
            os.write(tier.w, b"x")
            deadline = sent + 1.0
            while len(tier.rounds) < n:
                assert time.monotonic() < deadline, "the fd did not wake a round"
                time.sleep(0.0005)
            assert tier.rounds[-1] - sent < 0.5
        assert thread.woken_rounds == 2
    finally:
        assert thread.stop()


def test_news_during_a_woken_round_waits_for_the_interval(fd_tier):
    """An fd readable as soon as a woken round ends (news during it, or not cleared by
    it) gets the next round an interval after the woken one, not at once."""
    tier = fd_tier()
    poll = tier.poll
    news_in_round = [True]

    def poll_with_news() -> None:
        poll()
        if len(tier.rounds) == 2 and news_in_round.pop():
            os.write(tier.w, b"x")  # during the woken round, after it drained the pipe

    tier.poll = poll_with_news
    thread = started(tier, 0.3)
    try:
        os.write(tier.w, b"x")
        deadline = time.monotonic() + 2
        while len(tier.rounds) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert 0.3 - 0.01 <= tier.rounds[2] - tier.rounds[1] < 0.3 + 0.2
    finally:
        assert thread.stop()


def test_an_fd_no_round_clears_costs_one_round_per_interval_not_a_spin(fd_tier):
    tier = fd_tier(drain=False)
    interval = 0.02
    thread = started(tier, interval)
    try:
        os.write(tier.w, b"x")  # readable for good
        n0, t0 = len(tier.rounds), time.monotonic()
        time.sleep(0.5)
        rounds, seconds = len(tier.rounds) - n0, time.monotonic() - t0
        assert thread.is_alive()
    finally:
        assert thread.stop()
    assert rounds <= seconds / interval + 2, f"{rounds} rounds in {seconds:.2f} s"
    assert rounds >= 5  # and it still polls


def test_without_news_a_round_still_runs_every_interval(fd_tier):
    tier = fd_tier()
    thread = started(tier, 0.02)
    try:
        n0 = len(tier.rounds)
        time.sleep(0.3)
        rounds = len(tier.rounds) - n0
    finally:
        assert thread.stop()
    assert 5 <= rounds <= 0.3 / 0.02 + 2
    assert thread.woken_rounds == 0


def test_an_fd_closed_between_rounds_does_not_spin(fd_tier):
    """A tier may close an fd after giving it (an endpoint restarting): poll(2) then
    reports it invalid; the thread waits the interval and asks again."""
    tier = fd_tier()
    r2, w2 = os.pipe()
    os.close(w2)
    gone = [r2]
    tier.poll_fds = lambda: tuple(gone)
    interval = 0.02
    thread = TierPollThread(tier.lock, tier.poll, interval, [tier])
    try:
        time.sleep(0.05)
        with tier.lock:
            os.close(r2)  # the number stays in the thread's poll set
        n0, t0 = len(tier.rounds), time.monotonic()
        time.sleep(0.3)
        rounds, seconds = len(tier.rounds) - n0, time.monotonic() - t0
        assert thread.is_alive()
    finally:
        assert thread.stop()
    assert rounds <= seconds / interval + 2, f"{rounds} rounds in {seconds:.2f} s"


def test_stop_ends_a_wait_on_fds_at_once(fd_tier):
    tier = fd_tier()
    thread = started(tier, 30.0)
    t0 = time.monotonic()
    assert thread.stop()
    assert time.monotonic() - t0 < 1.0
    assert not thread.is_alive()


def test_tiers_without_poll_fds_sleep_the_interval():
    rounds = []
    lock = threading.Lock()

    class Plain:
        pass

    thread = TierPollThread(lock, lambda: rounds.append(time.monotonic()), 0.02, [Plain()])
    try:
        time.sleep(0.3)
    finally:
        assert thread.stop()
    assert 5 <= len(rounds) <= 0.3 / 0.02 + 2
    assert thread.woken_rounds == 0
