#!/usr/bin/env python
"""What an engine step with nothing to do costs the scheduler thread, call by call, shmtier
against vLLM's own tiering: the fixed per-step cost that decides the long run's step p50
(bench/README.md, "Per-step fixed costs").

Run from a checkout (vLLM importable for its side; without it only shmtier's runs)::

    .venv/bin/python -m bench.idle_step                       # 5 repeats x 400 steps (~30 s)
    .venv/bin/python -m bench.idle_step --repeats 7 --json bench/results/idle_step.json

Each manager is built as ``bench/tiering_steps.py`` builds it (shmtier/bench/managers.py:
a CPU tier of ``--cpu-mib`` and an fs tier on a fresh temp directory, 1408 KiB chunks,
shmtier with its 2 tier worker processes and defaults; vLLM 0.34's
``TieringOffloadingManager`` with its fs tier). No request is ever made: every step is
idle. A step is what the connector calls when a step schedules nothing (shmtier/bench/
driver.py): ``on_schedule_end``, ``has_pending_work``, ``get_stats``, ``take_events``, under
the manager's lock, each timed on-CPU (``thread_time_ns``). Between steps the thread sleeps
``--step-ms`` and reads ``--sweep-mib`` of memory, standing in for a forward pass, which
leaves the caches as a real step finds them (a tight loop of the same calls measures warm
caches: a third of the cost). Per repeat, interleaved (order rotated): ``--steps`` steps per
manager; each call's p50 and mean µs. Figures: median [min-max] over repeats of each, and
the ratio of shmtier's median to vLLM's. Every manager, segment and directory is removed at
the end, also on error or SIGTERM.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from shmtier.bench.common import exit_through_finally, fmt_mr, med_range, rotated, write_json
from shmtier.bench.driver import Config
from shmtier.bench.managers import MAKERS, known_manager, make_shmtier, sweep_shm

CALLS = ("on_schedule_end", "has_pending_work", "get_stats", "take_events")


def _steps(mut, steps: int, step_s: float, sweep: np.ndarray) -> dict[str, list[float]]:
    """On-CPU µs of each call over ``steps`` idle steps of ``mut``'s manager."""
    man = mut.manager
    end = mut.ScheduleEndContext((), ())
    lock = getattr(man, "lock", None)  # shmtier's manager lock; vLLM's connector has its own
    out: dict[str, list[float]] = {c: [] for c in CALLS + ("step",)}
    clock = time.thread_time_ns
    for _ in range(steps):
        time.sleep(step_s)
        sweep.sum()  # the forward pass's memory traffic
        if lock is not None:
            lock.acquire()
        try:
            t0 = clock()
            man.on_schedule_end(end)
            t1 = clock()
            man.has_pending_work()
            t2 = clock()
            man.get_stats()
            t3 = clock()
            list(man.take_events())
            t4 = clock()
        finally:
            if lock is not None:
                lock.release()
        for name, a, b in zip(CALLS, (t0, t1, t2, t3), (t1, t2, t3, t4)):
            out[name].append((b - a) / 1e3)
        out["step"].append((t4 - t0) / 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=400, help="idle steps per manager and repeat")
    ap.add_argument("--step-ms", type=float, default=5.0, help="sleep between steps")
    ap.add_argument("--sweep-mib", type=int, default=6, help="memory read between steps")
    ap.add_argument("--cpu-mib", type=int, default=64, help="the CPU tier's size")
    ap.add_argument("--managers", default="shmtier,vllm",
                    help="comma-separated: vllm, shmtier, shmtier@VARIANT (as tiering_steps.py)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    exit_through_finally()
    cfg = Config(chunk_bytes=1408 << 10, cpu_bytes=args.cpu_mib << 20, step_ms=args.step_ms,
                 max_running=1, batch=1, workers=2, dir=tempfile.gettempdir())
    sweep = np.ones(args.sweep_mib << 20, dtype=np.uint8)
    built: dict = {}
    runs: dict[str, list[dict]] = {}
    load = [os.getloadavg()[0]]
    try:
        for name in args.managers.split(","):
            if not known_manager(name):
                ap.error(f"--managers: {name!r} is not vllm, shmtier or shmtier@VARIANT")
            if name == "vllm":
                try:
                    import vllm.v1.kv_offload.tiering.manager  # noqa: F401
                except ImportError as e:
                    print(f"vLLM's side skipped: {e}")
                    continue
            safe = name.replace("@", "_").replace("+", "_")
            root = tempfile.mkdtemp(prefix=f"idle-step-{safe}-")
            engine_id = f"bench-idle-{safe}-{os.getpid()}"
            built[name] = (None, root, engine_id)  # removed even if the maker fails
            base, _, variant = name.partition("@")
            mut = (make_shmtier(cfg, root, engine_id, variant) if base == "shmtier"
                   else MAKERS[base](cfg, root, engine_id))
            built[name] = (mut, root, engine_id)
            runs[name] = []
        time.sleep(2.0)  # tier workers up, start-up listings done
        for r in range(args.repeats):
            for name in rotated(list(runs), r):
                gc.collect()
                runs[name].append(_steps(built[name][0], args.steps, args.step_ms / 1e3, sweep))
        load.append(os.getloadavg()[0])
    finally:
        for mut, root, engine_id in built.values():
            if mut is not None:
                mut.close()
            shutil.rmtree(root, ignore_errors=True)
            sweep_shm(engine_id)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs (shared, noisy), load avg "
          f"{load[0]:.2f} at start, {load[-1]:.2f} at end; {args.repeats} repeats x "
          f"{args.steps} idle steps per manager, interleaved; {args.step_ms:g} ms sleep and "
          f"{args.sweep_mib} MiB read between steps")
    print("on-CPU µs per call: p50 and mean per repeat, median [min-max] over repeats")
    figures: dict = {}
    for name, reps in runs.items():
        figures[name] = {}
        for call in CALLS + ("step",):
            p50 = med_range([statistics.median(rep[call]) for rep in reps])
            mean = med_range([statistics.fmean(rep[call]) for rep in reps])
            figures[name][call] = {"p50": p50, "mean": mean}
            print(f"  {name:16s} {call:17s} p50 {fmt_mr(p50, 1)}   mean {fmt_mr(mean, 1)}")
    ours = [name for name in figures if name != "vllm"]
    if ours and "vllm" in figures:
        print("against vLLM, ratio of the medians (p50): " + ", ".join(ours))
        for call in CALLS + ("step",):
            b = figures["vllm"][call]["p50"][0]
            print(f"  {call:17s} " + "  ".join(f"{figures[n][call]['p50'][0] / b:.2f}x"
                                                 for n in ours))
    if args.json:
        write_json(args.json, {"args": vars(args), "load": load, "figures": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
