#!/usr/bin/env python
"""What the tier-poll thread costs the scheduler process while there is nothing to poll.

Run from a checkout::

    .venv/bin/python -m bench.tier_poll_round                       # 5 x 2 s at 1 ms (the default interval)
    .venv/bin/python -m bench.tier_poll_round --interval-ms 1,5,20 --repeats 3
    .venv/bin/python -m bench.tier_poll_round --fd     # + rounds waiting on a tier's fd
    .venv/bin/python -m bench.tier_poll_round --fd --news-ms 5   # + news latency, tick vs fd

The tiering manager starts a tier-poll thread (shmtier/scheduler/tiering/poll_thread.py)
when a tier opts in to off-thread polling (peer tiers; shmtier's ``fs`` tier does not);
it runs a round every ``tier_poll_interval_s`` (default 1 ms, shmtier/config.py). Here a
real ``TierPollThread`` with a real lock runs rounds whose poll does nothing, so what is
measured is the round itself: taking the lock, the wait, the wake-up. ``--fd`` adds runs
where the polled tier declares ``poll_fds`` (a pipe nobody writes: the thread waits in
``poll(2)`` on it for the interval instead of sleeping). ``--news-ms N``: every N ms
(randomly phased) this thread writes a byte to the pipe, as a peer's message would
arrive; the round that reads it records the time since the write ("news µs"; without
``--fd`` the round finds it at its next tick, as before poll_fds). Per run: rounds per
second and the thread's own CPU clock (``pthread_getcpuclockid``) per round and as a share
of one core; median [min-max] over the runs. The host is shared: the load average is
printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time

from shmtier.bench.common import fmt_mr, med_range
from shmtier.scheduler.tiering.poll_thread import TierPollThread


class _PipeTier:
    """A polled tier with a pipe: its round reads what was written (the news); with
    ``fd`` it declares the read end as ``poll_fds``."""

    def __init__(self, fd: bool):
        self.r, self.w = os.pipe2(os.O_NONBLOCK)
        if fd:
            self.poll_fds = lambda: (self.r,)
        self.sent_at = 0.0
        self.latencies: list[float] = []

    def take(self) -> None:
        try:
            os.read(self.r, 4096)
        except BlockingIOError:
            return
        self.latencies.append(time.perf_counter() - self.sent_at)


def one_run(interval_s: float, seconds: float, fd: bool = False,
            news_s: float = 0.0) -> tuple[float, float, float, float]:
    """(rounds per second, thread CPU µs per round, thread CPU share of a core, median
    µs from a write to the round that read it (nan without news))."""
    rounds = [0]
    tier = _PipeTier(fd)

    def poll() -> None:
        rounds[0] += 1
        tier.take()

    thread = TierPollThread(threading.Lock(), poll, interval_s, [tier])
    try:
        clock = time.pthread_getcpuclockid(thread._thread.ident)
        time.sleep(0.1)  # past its start
        c0, n0, w0 = time.clock_gettime(clock), rounds[0], time.perf_counter()
        end = w0 + seconds
        while news_s and time.perf_counter() < end:
            time.sleep(news_s * random.uniform(0.5, 1.5))
            tier.sent_at = time.perf_counter()
            os.write(tier.w, b"x")
        time.sleep(max(0.0, end - time.perf_counter()))
        c1, n1, w1 = time.clock_gettime(clock), rounds[0], time.perf_counter()
    finally:
        thread.stop()
        os.close(tier.r)
        os.close(tier.w)
    n = max(1, n1 - n0)
    news = statistics.median(tier.latencies) * 1e6 if tier.latencies else float("nan")
    return n / (w1 - w0), (c1 - c0) / n * 1e6, (c1 - c0) / (w1 - w0), news


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval-ms", default="1", help="comma-separated round intervals in ms")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0, help="per run")
    ap.add_argument("--fd", action="store_true", help="also runs with a tier fd to wait on")
    ap.add_argument("--news-ms", type=float, default=0.0,
                    help="write to the tier's pipe about every this many ms (0: never)")
    args = ap.parse_args(argv)
    try:
        intervals = [float(x) / 1e3 for x in args.interval_ms.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--interval-ms {args.interval_ms!r}: expected comma-separated numbers of ms")
    if args.news_ms < 0:
        ap.error(f"--news-ms {args.news_ms:g}: expected 0 (no news) or a positive number of ms")
    if not intervals or min(intervals) <= 0:
        ap.error(f"--interval-ms {args.interval_ms!r}: expected positive numbers of ms")
    print(f"tier-poll thread, {'rounds with news' if args.news_ms else 'empty rounds'}: {args.repeats} runs x {args.seconds:g} s per interval, "
          f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f} at start")
    for interval in intervals:
        modes = (False, True) if args.fd else (False,)
        # with --fd the modes' runs alternate: the host's load moves between runs
        runs = {fd: [] for fd in modes}
        for _ in range(args.repeats):
            for fd in modes:
                runs[fd].append(one_run(interval, args.seconds, fd, args.news_ms / 1e3))
        for fd in modes:
            rate, per_round, share = (med_range([r[i] for r in runs[fd]]) for i in range(3))
            news = (f", news {fmt_mr(med_range([r[3] for r in runs[fd]]), 0)} µs after the "
                    f"write" if args.news_ms else "")
            print(f"  interval {interval * 1e3:g} ms{', fd' if fd else ''}: {fmt_mr(rate, 0)} "
                  f"rounds/s, {fmt_mr(per_round, 1)} µs CPU per round, "
                  f"{fmt_mr(tuple(x * 100 for x in share), 1)} % of a core{news}")
    print(f"load avg at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
