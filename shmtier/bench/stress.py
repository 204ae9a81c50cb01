"""``shmtier bench --stress``: shmtier's stress run (``shmtier.stress.run_stress``, what
``shmtier run`` runs) under sustained load with every fault on: tier workers SIGKILLed at
random intervals, chunk files damaged (payload bytes flipped, cut, header overwritten), the
fs namespace and then the root removed, chunk files replaced by sparse 5 GiB files, the
namespace directory replaced by a symlink while a tier worker restarts, a tier worker
stopped (SIGSTOP) past the pool's heartbeat timeout, the scheduler SIGKILLed halfway and
warm-restarted on its segment, and the root's filesystem (a tmpfs mounted for the run;
"skipped: <why>" in the verdict where mounting is not permitted) filled for a while.
Invariants are checked while the load runs (no wrong byte, rows and pins equal to the jobs
in flight, every job completed exactly once, every manager call under a bound) and at the
end (index equals files, damaged files accounted for, a fresh engine's scan agrees and no
file too big for a chunk is left, workers restarted under the namespace link started and
stores resumed after it, nothing left in /dev/shm).

The verdict is the run's ``StressResult``: ``stress.json`` under ``--out`` holds each
check's name, verdict and counts, the violations with their steps, what each fault did,
the latency figures and the host's load average; stdout gets the run's report and a
one-line verdict. Exit code 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import json
import os
import time

#: Load and fault settings per size: (conversations, turns, kill_every_s, stall_s).
SIZES = {"quick": (16, 4, 1.0, 2.5), "default": (64, 6, 0.8, 3.0), "soak": (400, 12, 2.0, 3.0)}


def stress_chaos(kill_every_s: float, stall_s: float):
    """The faults ``--stress`` injects, at fractions of the trace."""
    from shmtier.stress import Chaos

    return Chaos(kill_every_s=kill_every_s, kill_worker_at=(0.1,),
                 delete_namespace_at=(0.3,), delete_root_at=(0.6,),
                 root_gone_s=0.2, corrupt_at=(0.2, 0.45, 0.9), corrupt_files=4,
                 fill_root_at=0.7, fill_for=0.1, stall_at=(0.35,), stall_s=stall_s,
                 warm_restart_at=0.5, big_file_at=(0.4, 0.85), big_files=2,
                 namespace_link_at=(0.12,), link_for=0.06)


def run_stress_bench(args) -> int:
    from shmtier.stress import StressResult, run_stress

    size = "quick" if args.quick else "soak" if args.soak else "default"
    conversations, turns, kill_every, stall_s = SIZES[size]
    chaos = stress_chaos(kill_every, stall_s)
    out_dir = args.out or os.path.abspath(time.strftime("shmtier-bench-stress-%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    result = StressResult()
    load_before = os.getloadavg()
    t0 = time.monotonic()
    rc = run_stress(conversations, turns, 4, 48, args.workers, seed=args.seed, chaos=chaos,
                    result=result)
    verdict = {**result.as_dict(), "exit_code": rc, "wall_s": time.monotonic() - t0,
               "size": size, "load": {"conversations": conversations, "turns": turns,
                                      "chunks_per_turn": 4, "cpu_chunks": 48,
                                      "workers": args.workers, "seed": args.seed},
               "chaos": chaos.as_dict(),
               "loadavg": {"before": load_before, "after": os.getloadavg()}}
    path = os.path.join(out_dir, "stress.json")
    with open(path, "w") as f:
        json.dump(verdict, f, indent=1)
    print(f"stress verdict: {verdict['verdict']} ({verdict['passed']} checks passed, "
          f"{verdict['failed']} failed, {sum(result.violation_counts.values())} invariant "
          f"violations); {_fault_line(result.faults)}; wrote {path}")
    return 0 if rc == 0 else 1


def _fault_line(faults: dict) -> str:
    """The faults injected, one phrase each (a skipped one says why)."""
    parts = []
    for name, c in faults.items():
        if "skipped" in c:
            parts.append(f"{name} skipped: {c['skipped']}")
            continue
        shown = {k: v for k, v in c.items() if isinstance(v, (int, float)) and k not in (
            "every_s", "stall_s", "at", "for", "tmpfs_bytes", "killed_pid")}
        parts.append(f"{name} " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else
                                           f"{k}={v}" for k, v in shown.items()))
    return "faults: " + "; ".join(parts)
