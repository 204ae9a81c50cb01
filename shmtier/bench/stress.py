"""``shmtier bench --stress``: shmtier's stress run (``shmtier.stress.run_stress``, what
``shmtier run`` runs) under sustained load with its fault injection on: tier workers
SIGKILLed at random intervals, the fs tier's namespace removed and the root itself removed
and made again mid-trace; at the end its checks (no wrong byte served, the tiers settle,
the fs index matches the files and the bytes-on-disk gauge, a fresh engine's scan agrees,
no segment or semaphore left). The verdict and the counts go to ``stress.json`` under
``--out`` as well as to stdout. Not yet here (issue 15): corrupting random files,
filling the fs root, stalling a backend, a warm restart of the scheduler, and invariants
checked while the load runs rather than at its end.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time


def run_stress_bench(args) -> int:
    from shmtier.stress import Chaos, run_stress

    if args.quick:
        conversations, turns, kill_every = 16, 3, 0.3
    elif args.soak:
        conversations, turns, kill_every = 400, 12, 2.0
    else:
        conversations, turns, kill_every = 64, 6, 0.5
    chaos = Chaos(kill_every_s=kill_every, delete_namespace_at=(0.3,), delete_root_at=(0.6,),
                  root_gone_s=0.5)
    out_dir = args.out or os.path.abspath(time.strftime("shmtier-bench-stress-%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    buf = io.StringIO()
    real = sys.stdout

    class Tee(io.TextIOBase):
        def write(self, text):
            buf.write(text)
            real.write(text)
            return len(text)

        def flush(self):
            real.flush()

    t0 = time.monotonic()
    with contextlib.redirect_stdout(Tee()):
        rc = run_stress(conversations, turns, 4, 48, args.workers, seed=args.seed, chaos=chaos)
    text = buf.getvalue()
    checks = [line.strip() for line in text.splitlines() if line.strip().startswith("[")]
    verdict = {"verdict": "PASS" if rc == 0 else "FAIL", "exit_code": rc,
               "wall_s": time.monotonic() - t0,
               "load": {"conversations": conversations, "turns": turns, "chunks_per_turn": 4,
                        "cpu_chunks": 48, "workers": args.workers, "seed": args.seed},
               "chaos": {"kill_every_s": kill_every, "delete_namespace_at": [0.3],
                         "delete_root_at": [0.6]},
               "checks": checks,
               "passed": sum(1 for c in checks if c.startswith("[ok]")),
               "failed": sum(1 for c in checks if c.startswith("[FAIL]")),
               "chaos_counts": next((line for line in text.splitlines()
                                     if line.startswith("chaos:")), None),
               "output": text}
    with open(os.path.join(out_dir, "stress.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    print(f"stress verdict: {verdict['verdict']} ({verdict['passed']} checks passed, "
          f"{verdict['failed']} failed); wrote {os.path.join(out_dir, 'stress.json')}")
    return 0 if rc == 0 else 1
