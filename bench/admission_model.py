#!/usr/bin/env python
"""Cascade admission on the bench traces, without timing: what each rule would write and
what the secondary tier would serve if every admitted cascade landed.

Run from a checkout::

    .venv/bin/python -m bench.admission_model                       # chat, docqa, agent
    .venv/bin/python -m bench.admission_model --chunk-kib 1408 --cpu-mib 1024   # design §10 scale

A model, not the engine: requests are replayed one at a time in arrival order (no
concurrency, no backlog, nothing dropped) through an LRU CPU tier of the bench's size and an
unbounded secondary tier, with the rule objects of shmtier/scheduler/tiering/admission.py
called where the manager calls them. Per request, as the bench's driver does
(shmtier/bench/driver.py): a lookup scan over the chunks after the GPU-cached ones until the
first miss (a CPU-tier hit refreshes the chunk; a secondary hit promotes it into the CPU
tier), the hits capped so one chunk is computed; the scan's CPU-tier hits go to the rule
(``on_hits``), promotions to ``on_promoted``; then every chunk not in the CPU tier is stored
(``on_store``). What the rule admits is written to the secondary tier at once. The
timed bench (tiering_steps.py) measures the same rules with real tier workers, where
cascades also queue and are dropped when the workers fall behind.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict

from shmtier.bench import trace as bench_trace
from shmtier.scheduler.tiering.admission import DEFAULT_WINDOW_PER_ROW, RULES, make_rule


def replay(trace, capacity: int, rule) -> dict:
    """One pass of ``trace`` through a ``capacity``-chunk LRU CPU tier and an unbounded
    secondary tier under ``rule``; counts of chunks."""
    cpu: OrderedDict = OrderedDict()
    secondary = set()
    read_back = set()
    n = dict(eligible=0, hit_cpu=0, hit_secondary=0, stored=0, cascaded=0)

    def insert(key):
        cpu[key] = None
        if len(cpu) > capacity:
            cpu.popitem(last=False)

    def cascade(keys):
        n["cascaded"] += len(keys)
        secondary.update(keys)

    for req in trace.requests:
        keys, g = req.keys, req.gpu_cached
        cpu_hits, promoted = [], []
        for key in keys[g:]:
            if key in cpu:
                cpu_hits.append(key)
            elif key in secondary:
                promoted.append(key)
            else:
                break
        hits = min(len(cpu_hits) + len(promoted), len(keys) - 1 - g)
        found = [k for k in keys[g:g + max(hits, 0)]]
        n["eligible"] += len(keys) - g
        for key in found:
            if key in cpu:
                n["hit_cpu"] += 1
                cpu.move_to_end(key)
            else:
                n["hit_secondary"] += 1
                read_back.add(key)
                insert(key)
        cascade(rule.on_hits([k for k in cpu_hits if k in cpu]))
        rule.on_promoted([k for k in promoted if k in found])
        start = g + hits if hits > 0 else 0
        stored = [k for k in keys[start:] if k not in cpu]
        for key in stored:
            insert(key)
        n["stored"] += len(stored)
        cascade(rule.on_store(stored))
    n["distinct_cascaded"] = len(secondary)
    n["read_back"] = len(read_back)
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-kib", type=int, default=256)
    ap.add_argument("--cpu-mib", type=int, default=128)
    ap.add_argument("--workloads", default="chat,docqa,agent")
    ap.add_argument("--windows", default=f"{DEFAULT_WINDOW_PER_ROW}",
                    help="second_touch windows to try, as multiples of the CPU tier's rows")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    capacity = (args.cpu_mib << 20) // (args.chunk_kib << 10)
    gib_per_chunk = (args.chunk_kib << 10) / 2 ** 30
    print(f"admission model: chunk {args.chunk_kib} KiB, CPU tier {args.cpu_mib} MiB = {capacity} "
          f"chunks (LRU), secondary unbounded, every admitted cascade lands")
    print(f"{'trace':<8}{'rule':<22}{'hit CPU':>9}{'hit 2nd':>9}{'recomp':>8}{'cascaded':>10}"
          f"{'GiB':>8}{'read back':>10}{'hit/GiB':>9}{'vs all':>8}")
    for kind in args.workloads.split(","):
        trace = bench_trace.generate(kind, "default", args.seed)
        base = None
        variants = [("all", 1)] + [("second_touch", float(w)) for w in args.windows.split(",")]
        for name, per_row in variants:
            assert name in RULES
            n = replay(trace, capacity, make_rule(name, max(1, int(per_row * capacity))))
            elig = n["eligible"]
            h2 = n["hit_secondary"] / elig
            gib = n["cascaded"] * gib_per_chunk
            per_gib = h2 / gib if gib else 0.0
            base = base or per_gib
            label = name if name == "all" else f"{name} (x{per_row:g})"
            print(f"{kind:<8}{label:<22}{n['hit_cpu'] / elig:>9.3f}{h2:>9.3f}"
                  f"{1 - (n['hit_cpu'] + n['hit_secondary']) / elig:>8.3f}{n['cascaded']:>10}"
                  f"{gib:>8.2f}{n['read_back'] / max(1, n['distinct_cascaded']):>10.3f}"
                  f"{per_gib:>9.3f}{per_gib / base if base else 0:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
