"""The scheduler thread's cost per pool job of the result path (issue 30): what
``Dispatch.commit`` registers for the job's result, ``jobs.decode_result`` (C) of each
part's result, ``Dispatch.complete`` (the merge into a ``PoolResult``) and
``Dispatch.take``. Encoding the results (the worker's side) and planning the job are
outside the timed region. Prints µs per pool job for each case: the least of ``--repeats``
runs in this process (each ``--jobs`` pool jobs, gc off).

    nice -n 10 python -m bench.result_path --repeats 3

Figures, before and after the PoolResult became the merge of the wire records:
bench/README.md ("result_path.py").
"""

from __future__ import annotations

import argparse
import gc
import time

from shmtier.scheduler.pool.dispatch import Dispatch
from shmtier.shared import jobs
from shmtier.shared.jobs import Outcome

# name, op, keys, workers, results per part, listed keys
CASES = [("store 16 keys, 1 part", "store", 16, 1, 1, 0),
         ("load 4 keys, 1 part", "load", 4, 1, 1, 0),
         ("probe 1 key", "probe", 1, 1, 1, 0),
         ("load 64 keys, 2 workers", "load", 64, 2, 1, 0),
         ("store 64 keys, 4 slices", "store", 64, 1, 4, 0),
         ("scan, 500 listed", "scan", 0, 1, 1, 500)]


def answers(planned: list, slices: int, listed: int) -> list[bytes]:
    """The encoded results of ``planned``'s parts: each in ``slices`` pieces (``more``
    on all but the last), every key OK, ``listed`` keys listed."""
    out = []
    for _, part_id, _, keys, _ in planned:
        n = len(keys)
        step = -(-n // slices) if n else 0
        starts = list(range(0, n, step)) if n else [0]
        names = [b"L%015d" % j for j in range(listed)]
        for i, start in enumerate(starts):
            m = len(keys[start:start + step]) if n else 0
            out.append(jobs.encode_result(jobs.Result(
                part_id, [Outcome.OK] * m, [4096] * m, [2000] * m + [3000] * listed,
                [0.001] * m, 0.0005, "", names, i < len(starts) - 1, 0)))
    return out


def run(op: str, nkeys: int, workers: int, slices: int, listed: int, iters: int) -> float:
    """µs per pool job of the timed region, over ``iters`` pool jobs."""
    d = Dispatch(workers, 1 << 20, 60.0)
    live = list(range(workers))
    total = 0
    gc.disable()
    try:
        for it in range(iters):
            keys = [b"%08d-%08d" % (it, i) for i in range(nkeys)]
            rows = list(range(nkeys)) if op in ("store", "load") else None
            pool_id, planned = d.plan(op, 0, keys, rows, None, live)
            payloads = answers(planned, slices, listed)
            t0 = time.perf_counter_ns()
            d.commit(pool_id, op, 0, keys, planned, 1.0)
            for raw in payloads:
                d.complete(jobs.decode_result(raw))
            done = d.take(0)
            total += time.perf_counter_ns() - t0
            assert len(done) == 1 and done[0].outcomes == [Outcome.OK] * nkeys
    finally:
        gc.enable()
    return total / iters / 1000


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per case (the least counts)")
    ap.add_argument("--jobs", type=int, default=2000, help="pool jobs per run")
    args = ap.parse_args(argv)
    for name, op, nkeys, workers, slices, listed in CASES:
        iters = args.jobs if not listed else max(1, args.jobs // 7)
        best = min(run(op, nkeys, workers, slices, listed, iters) for _ in range(args.repeats))
        print(f"{name:28s} {best:7.2f} µs")


if __name__ == "__main__":
    main()
