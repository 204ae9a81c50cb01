#!/usr/bin/env python
"""What publishing the scheduler's statistics into the segment costs the scheduler thread.

Run from a checkout::

    .venv/bin/python -m bench.stats_publish                # 7 repeats (~20 s)
    .venv/bin/python -m bench.stats_publish --repeats 3 --calls 5000 --json bench/results/stats_publish.json

A real engine's manager (``TieringOffloadingSpec(...).get_manager()``: its segment, an fs
tier on a fresh temp dir, one tier worker process) is stepped as the connector steps it:
``on_schedule_end`` then ``get_stats`` (whose payload the publisher folds,
shmtier/scheduler/stats_publisher.py), each step after a few lookups so the payload carries
the lookup counters. Per repeat, interleaved (order rotated), ``--calls`` steps with the
publisher on (the default interval, 0.1 s: the tight loop publishes about every 0.1 s of
it) and off (the manager's publisher detached, as ``SHMTIER_STATS_INTERVAL_S=0`` has it);
µs per ``get_stats`` call. Then ``publish()`` alone (what a step pays every 0.1 s) and
``observe()`` alone on one step's payload (what every step pays), µs per call. Figures: median [min-max] over repeats, with the load average.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

from shmtier.bench.common import exit_through_finally, fmt_mr, med_range, rotated, write_json
from shmtier.config import KVLayout
from shmtier.contract import ReqContext, ScheduleEndContext
from shmtier.spec import TieringOffloadingSpec

END = ScheduleEndContext((), ())


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def _steps(manager, calls: int, keys: list) -> float:
    """µs per get_stats over ``calls`` steps (lookups and on_schedule_end untimed)."""
    total = 0
    for n in range(calls):
        ctx = ReqContext(f"r{n}")
        with manager.lock:
            for k in keys:
                manager.lookup(k, ctx)
            manager.on_schedule_end(END)
            t = time.perf_counter_ns()
            manager.get_stats()
            total += time.perf_counter_ns() - t
            manager.on_request_finished(ctx)
    return total / calls / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3000, help="steps per configuration and repeat")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    exit_through_finally()
    root = tempfile.mkdtemp(prefix="stats-publish-")
    engine_id = f"bench-stats-{os.getpid()}"
    extra = {"cpu_bytes_to_use": 64 * 8192, "num_tier_workers": 1,
             "secondary_tiers": [{"type": "fs", "root_dir": root, "min_free_bytes": None}]}
    spec = TieringOffloadingSpec(extra, KVLayout("m", "bfloat16", 16, 8192, 1), engine_id)
    manager = spec.get_manager()
    load = [os.getloadavg()[0]]
    out: dict = {"on": [], "off": [], "publish": [], "observe": []}
    try:
        publisher = manager._publisher  # the bench toggles it: on as built, off detached
        if publisher is None:
            print("publishing is off (SHMTIER_STATS_INTERVAL_S=0): nothing to measure")
            return 2
        keys = [_key(i) for i in range(8)]
        _steps(manager, 500, keys)  # warm
        for r in range(args.repeats):
            for mode in rotated(["on", "off"], r):
                manager._publisher = publisher if mode == "on" else None
                gc.collect()
                out[mode].append(_steps(manager, args.calls, keys))
            manager._publisher = publisher
            t = time.perf_counter_ns()
            for _ in range(200):
                publisher.publish()
            out["publish"].append((time.perf_counter_ns() - t) / 200 / 1e3)
            with manager.lock:  # a step's payload (its lookup counters), folded alone
                ctx = ReqContext(f"o{r}")
                for k in keys:
                    manager.lookup(k, ctx)
                manager.on_schedule_end(END)
                manager._publisher = None
                payload = manager.get_stats()
                manager._publisher = publisher
                manager.on_request_finished(ctx)
                t = time.perf_counter_ns()
                for _ in range(2000):
                    publisher.observe(payload)  # publishes once per 0.1 s, as in a step
                out["observe"].append((time.perf_counter_ns() - t) / 2000 / 1e3)
        load.append(os.getloadavg()[0])
    finally:
        manager.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    on, off, pub, obs = (med_range(out[k]) for k in ("on", "off", "publish", "observe"))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs (shared, noisy), load avg "
          f"{load[0]:.2f} at start, {load[-1]:.2f} at end; {args.repeats} repeats x "
          f"{args.calls} steps, interleaved")
    print(f"get_stats µs/call, publisher on : {fmt_mr(on)}")
    print(f"get_stats µs/call, publisher off: {fmt_mr(off)}")
    print(f"difference of medians: {on[0] - off[0]:+.2f} µs/call")
    print(f"observe() alone µs/call (every step; publishes when 0.1 s are up): {fmt_mr(obs)}")
    print(f"publish() alone µs/call (paid once per 0.1 s): {fmt_mr(pub)}")
    if args.json:
        write_json(args.json, {"args": vars(args), "load": load, **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
