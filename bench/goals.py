#!/usr/bin/env python
"""Issue 14's goals (issue 29's long-run goals for ``--long`` sets), and issue 29's per-step
fixed costs, judged over saved tiering_steps.py sets.

Run from a checkout::

    .venv/bin/python -m bench.tiering_steps --managers shmtier,vllm --json set1.json
    .venv/bin/python -m bench.goals set1.json [set2.json ...] [--manager shmtier@pcauto]

Each file is one set (``tiering_steps.py --json``) with runs of vLLM and of the manager;
the runs of every file given are pooled (run i of each manager in a file is a pair), so
several sets on the same trace give one verdict over all their runs. Files of different
traces, scales or vLLM baselines (0.33, 0.34) are refused: a verdict mixes only like
with like. The table and its rules are shmtier/bench/goals.py's, the same tiering_steps.py
prints after a set.
"""

from __future__ import annotations

import argparse
import json
import sys

from shmtier.bench.baseline import saved_baseline
from shmtier.bench.goals import FIXED_COSTS, GOALS, LONG_RUN_GOALS, evaluate, format_goals

#: the arguments that make two sets the same experiment (trace and sizes)
SAME_SET_ARGS = ("long", "chunk_kib", "cpu_mib", "workload", "conversations", "requests", "zipf",
                 "arrival_rate", "step_ms", "max_running", "batch", "seed")


def pooled_runs(paths: list[str], manager: str) -> tuple[list, list, dict]:
    """The summaries of ``manager`` and of vLLM from every file, paired within each file
    (the shorter side of a file sets its pairs), and the experiment's arguments (with
    ``baseline``: the vLLM they ran against). Raises ValueError naming the file that lacks
    a manager or differs in an argument or in its vLLM baseline."""
    shm, vllm, args0 = [], [], None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if data.get("bench") != "tiering_steps":
            raise ValueError(f"{path}: not a tiering_steps.py JSON (bench={data.get('bench')!r})")
        sums = data["summaries"]
        for name in (manager, "vllm"):
            if not sums.get(name):
                raise ValueError(f"{path}: no runs of {name!r} (it has {sorted(sums)})")
        args = {k: data["args"].get(k) for k in SAME_SET_ARGS}
        args["baseline"] = saved_baseline(data)
        if args0 is None:
            args0 = args
        else:
            diff = {k: (args0[k], args[k]) for k in args if args0[k] != args[k]}
            if diff:
                raise ValueError(f"{path}: another experiment than {paths[0]} "
                                 f"({', '.join(f'{k} {a!r} vs {b!r}' for k, (a, b) in diff.items())})")
        n = min(len(sums[manager]), len(sums["vllm"]))
        shm += sums[manager][:n]
        vllm += sums["vllm"][:n]
    return shm, vllm, args0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("files", nargs="+", help="tiering_steps.py --json outputs of one experiment")
    ap.add_argument("--manager", default="shmtier", help="the manager judged against vllm")
    args = ap.parse_args(argv)
    try:
        shm, vllm, exp = pooled_runs(args.files, args.manager)
    except (OSError, ValueError, KeyError) as e:
        print(f"goals.py: {e}", file=sys.stderr)
        return 2
    long = bool(exp["long"])
    print(f"issue {29 if long else 14}'s goals over {len(shm)} run pairs from {len(args.files)} set(s): "
          f"{args.manager} vs {exp['baseline']}, chunk {exp['chunk_kib']} KiB, CPU tier "
          f"{exp['cpu_mib']} MiB, workload {exp['workload']}")
    column = exp["baseline"].removesuffix(" TieringOffloadingSpec")
    goals = LONG_RUN_GOALS if long else GOALS
    for line in format_goals(evaluate(shm, vllm, goals), args.manager, column):
        print("  " + line)
    print("issue 29's per-step fixed costs (the same rules):")
    for line in format_goals(evaluate(shm, vllm, FIXED_COSTS), args.manager, column):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
