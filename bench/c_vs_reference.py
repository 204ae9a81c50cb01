#!/usr/bin/env python
"""Do the scheduler's C helpers still pay for themselves? The CPU primary tier (LRU) per
engine step with its C helpers against the same manager on their pure-Python references
(issue 30).

Run from a checkout::

    nice -n 10 .venv/bin/python -m bench.c_vs_reference            # 10k chunks, 5 repeats (~1 min)
    .venv/bin/python -m bench.c_vs_reference --quick                 # smoke test (~5 s)
    .venv/bin/python -m bench.c_vs_reference --json bench/results/c_vs_reference.json

Method: bench/primary_calls.py's multi-turn chat trace and driver (the connector's
scheduler-half calls of each step, each timed with ``perf_counter_ns``) drive shmtier's
``CPUOffloadingManager`` over a private chunk table, LRU policy, events on, in these
variants:

* ``C``: as shipped (``_rows.RowIndex`` and ``first_accesses``, ``_lru.LRUCore``);
* ``rows py``: rows_reference.py's ``RowIndex`` and ``first_accesses`` instead;
* ``lru py``: lru_reference.py's ``LRUCore`` instead;
* ``both py``: both references;
* ``both py+heapq``: both, the LRU heap on ``heapq`` instead of the reference's sift loops
  (what a pure-Python replacement would use; same victims, ``heap_size`` may differ on ties).

The references are swapped in by rebinding the names primary.py and lru.py call. Variants
are interleaved, their order rotated per repeat, ``gc.collect()`` before each run. Per
variant: the manager time per step (mean, p50, p99) and µs per call of each call kind, as
the median over repeats [min-max], and the ratio of the medians to ``C``. Every variant must
make identical decisions (hits, loads, stores, evictions and their order, event keys).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import os
import platform
import sys
import time

from bench import primary_calls as pc
from shmtier.bench.common import fmt_mr, med_range, rotated, write_json

import shmtier.scheduler.policies.lru as lru_module
import shmtier.scheduler.primary as primary_module
from shmtier.scheduler import rows_reference
from shmtier.scheduler.policies import lru_reference

VARIANTS = ("C", "rows py", "lru py", "both py", "both py+heapq")
ROWS_PY = {(primary_module, "RowIndex"): rows_reference.RowIndex,
           (primary_module, "first_accesses"): rows_reference.first_accesses}
LRU_PY = {(lru_module, "LRUCore"): lru_reference.LRUCore}


def _heapq_rebuild(self) -> None:
    evictable, entry = self._evictable, self._entry
    self._heap = [entry(row) for row in range(self._n) if evictable[row]]
    heapq.heapify(self._heap)


HEAPQ = {(lru_reference, "_push"): heapq.heappush, (lru_reference, "_pop"): heapq.heappop,
         (lru_reference.LRUCore, "_rebuild_heap"): _heapq_rebuild}
SWAPS = {"C": {}, "rows py": ROWS_PY, "lru py": LRU_PY, "both py": {**ROWS_PY, **LRU_PY},
         "both py+heapq": {**ROWS_PY, **LRU_PY, **HEAPQ}}


@contextlib.contextmanager
def swapped(names: dict):
    """Rebind each (owner, name) to its replacement for the duration."""
    saved = {key: getattr(*key) for key in names}
    try:
        for (owner, name), value in names.items():
            setattr(owner, name, value)
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=10_000, help="CPU tier capacity (chunks)")
    p.add_argument("--repeats", type=int, default=5, help="runs per variant")
    p.add_argument("--quick", action="store_true", help="1000 chunks, 2 repeats")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="PATH", help="write every repeat's figures as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.chunks, args.repeats = min(args.chunks, 1000), min(args.repeats, 2)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or "C" not in names:
        p.error(f"--variants: {', '.join(unknown) or 'C is missing'}; choose from {VARIANTS}")
    priv = next(f for f in pc.load_flavors(False)[0] if f.name == "priv")
    workload = pc.make_workload(args.chunks, max(40, int(0.6 * args.chunks)), args.seed)
    max_running, batch = 16, 16

    print("bench: c_vs_reference - the CPU tier (LRU) per step, C helpers vs their "
          "pure-Python references")
    print(f"{time.strftime('%Y-%m-%d')}, python {platform.python_version()} on "
          f"{platform.machine()}, {os.cpu_count()} CPUs (shared: read medians, mind spreads)")
    print(f"method: bench/primary_calls.py's trace and driver ({workload.describe()}; "
          f"{args.chunks} chunks, up to {max_running} running requests, offers of {batch}, "
          f"events on), CPUOffloadingManager over a private table, policy lru;")
    print(f"  {args.repeats} repeats per variant, interleaved, order rotated per repeat, gc "
          "before each run; figures: median over repeats [min-max]; ratio = median / C's.")

    results: dict = {n: [] for n in names}
    for r in range(args.repeats):
        for n in rotated(names, r):
            with swapped(SWAPS[n]):
                run = pc.run_one(priv, workload, "lru", True, max_running, batch)
            results[n].append(pc.summarise(run))
    same, text = pc.check_decisions(results, names)
    print(f"decisions identical across variants and repeats: {'yes' if same else 'NO'} ({text})")

    def figure(n, pick):
        return med_range([pick(s) for s in results[n]])

    rows = [("step mean µs", lambda s: s["step_us_mean"]),
            ("step p50 µs", lambda s: s["step_us_p50"]),
            ("step p99 µs", lambda s: s["step_us_p99"])]
    rows += [(f"{k} µs/call", lambda s, k=k: s["us_per_call"][k]) for k in pc.KINDS
             if results["C"][0]["us_per_call"][k] is not None]
    width = max(len(label) for label, _ in rows)
    print(f"\n{'':{width}}  " + "  ".join(f"{n:>27}" for n in names))
    for label, pick in rows:
        base = figure("C", pick)
        cells = []
        for n in names:
            mr = figure(n, pick)
            ratio = "" if n == "C" or not base or not mr else f" {mr[0] / base[0]:.2f}x"
            cells.append(f"{fmt_mr(mr, 1) + ratio:>27}")
        print(f"{label:{width}}  " + "  ".join(cells))
    if args.json:
        write_json(args.json, {"bench": "c_vs_reference", "date": time.strftime("%Y-%m-%d"),
                               "config": vars(args), "decisions_identical": same,
                               "results": results})
        print(f"\nwrote {args.json}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
