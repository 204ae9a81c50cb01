#!/usr/bin/env python
"""What the slowest calls of one shmtier manager method spent their time on.

Run from a checkout::

    .venv/bin/python -m bench.slowest_calls prepare_store            # default trace, 2 runs
    .venv/bin/python -m bench.slowest_calls get_stats --keep 6 -- --chunk-kib 1408 --cpu-mib 1024

Runs ``tiering_steps.py --managers shmtier`` (the arguments after ``--`` go to it; default
``--repeats 2``) with every call of ``TieringOffloadingManager.<method>`` under a cProfile
of its own, and prints the profiles of the ``--keep`` slowest calls (wall time under the
profiler, which adds about 1 µs per function call), cumulative order. Where a slow call's
time sits in one line of code that takes µs when warm (``tottime`` of a function called
once), the thread stalled there (descheduled, or a fault the host was slow to serve) rather
than ran that code (bench/README.md, "Issue 14's goals judged by bench/goals.py"). tiering_steps.py's own figures follow, inflated by
the profiling of that one method.
"""

from __future__ import annotations

import argparse
import cProfile
import heapq
import io
import pstats
import sys
import time

from shmtier.scheduler.tiering.manager import TieringOffloadingManager


class SlowestCalls:
    """Wraps ``TieringOffloadingManager.<method>`` (``install``/``uninstall``) so each call
    runs under its own cProfile; keeps the ``keep`` slowest as (wall s, call number, text)."""

    def __init__(self, method: str, keep: int):
        self.method, self.keep = method, keep
        self.slowest: list[tuple[float, int, str]] = []  # a min-heap on wall
        self.calls = 0
        self._orig = getattr(TieringOffloadingManager, method)

    def install(self) -> None:
        orig, record = self._orig, self._record

        def profiled(manager, *args, **kwargs):
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            try:
                return orig(manager, *args, **kwargs)
            finally:
                prof.disable()
                record(time.perf_counter() - t0, prof)

        setattr(TieringOffloadingManager, self.method, profiled)

    def uninstall(self) -> None:
        setattr(TieringOffloadingManager, self.method, self._orig)

    def _record(self, wall: float, prof: cProfile.Profile) -> None:
        self.calls += 1
        if len(self.slowest) >= self.keep and wall <= self.slowest[0][0]:
            return
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(20)
        item = (wall, self.calls, out.getvalue())
        if len(self.slowest) < self.keep:
            heapq.heappush(self.slowest, item)
        else:
            heapq.heapreplace(self.slowest, item)

    def report(self) -> list[str]:
        lines = [f"the {len(self.slowest)} slowest of {self.calls} {self.method} calls "
                 "(wall under the profiler; cumulative order, lines under 1 µs left out):"]
        for wall, number, text in sorted(self.slowest, reverse=True):
            lines.append(f"--- call {number}: {wall * 1e6:.0f} µs")
            lines += [line for line in text.splitlines()
                      if line.strip() and not line.lstrip().startswith(("Ordered", "List reduced"))
                      and "0.000    0.000    0.000    0.000" not in line]
        return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("method", help="a TieringOffloadingManager method, e.g. prepare_store")
    ap.add_argument("--keep", type=int, default=4, help="slowest calls shown")
    args = ap.parse_args(ours)
    if not callable(getattr(TieringOffloadingManager, args.method, None)):
        print(f"slowest_calls.py: TieringOffloadingManager has no method {args.method!r}",
              file=sys.stderr)
        return 2
    if "--repeats" not in theirs:
        theirs += ["--repeats", "2"]
    from bench import tiering_steps

    slow = SlowestCalls(args.method, args.keep)
    slow.install()
    try:
        rc = tiering_steps.main(["--managers", "shmtier", *theirs])
    finally:
        slow.uninstall()
    print()
    print("\n".join(slow.report()))
    return rc


if __name__ == "__main__":
    sys.exit(main())
