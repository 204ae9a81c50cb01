"""The stress run's warm restart: the scheduler is a separate process that plays the
trace up to the restart point and is SIGKILLed there, as a crashed engine would be; the
run's own process then opens the same engine with ``warm_restart: true``, re-attaches to
the segment the dead one left (docs/design.md §3: the chunk table and arena survive; the
new owner keeps the ready rows and frees the rows of writes that never completed) and
plays the rest of the trace.

Who calls: ``run_stress`` (``first_scheduler``), on its scheduler thread; it blocks until
the child reached the restart point (bounded by ``timeout_s``) and kills it. It does not
wait for the dead scheduler's tier workers: the restart follows at once, as a supervisor
restarting a crashed engine would, and the new scheduler's pool makes sure no slot keeps
an old worker (the owner generation: ``workers/job_loop.py``,
``shmtier/scheduler/pool/old_holders.py``); the run checks that afterwards. The child is
``python -m shmtier.stress.restart PARAMS``: it prints one ``RESULT {json}`` line once it
has played its requests and then waits on its stdin to be killed; its work in flight
(cascades, promotions, pinned rows) is cut off.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from shmtier.shared import procinfo
from shmtier.shared.segment import SHM_DIR, segment_name

_PREFIX = "RESULT "


def first_scheduler(params: dict, timeout_s: float = 600.0) -> dict:
    """Run the child on ``params`` (see ``_child``), kill it once it has played its part
    and return what it reported, with ``old_workers`` (``[pid, start time]`` of its tier
    workers still running right after the kill), ``segment_present`` (its segment still
    there then) and ``killed_pid``."""
    proc = subprocess.Popen([sys.executable, "-m", "shmtier.stress.restart", json.dumps(params)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    # what the new scheduler imports, loaded while the child plays: the restart then follows
    # the kill within milliseconds (inside the workers' 1 s owner check), and the stale
    # segment has no time to be taken by another suite's clean-up
    import torch  # noqa: F401

    import shmtier.spec  # noqa: F401
    try:
        report = None
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            if line.startswith(_PREFIX):
                report = json.loads(line[len(_PREFIX):])
                break
            sys.stdout.write(line)
            if time.monotonic() > deadline:
                break
        if report is None:
            raise RuntimeError(f"the first scheduler (pid {proc.pid}) exited or timed out "
                               f"before the restart point (exit code {proc.poll()})")
    finally:
        proc.send_signal(signal.SIGKILL)  # the crash
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    report["killed_pid"] = proc.pid
    report["killed_at"] = time.monotonic()
    report["old_workers"] = [[pid, start] for pid in procinfo.tier_worker_pids(params["engine_id"])
                             if (start := procinfo.start_time(pid)) is not None]
    # a stale segment is what `shmtier clean` (run anywhere on the host) removes
    report["segment_present"] = os.path.exists(
        os.path.join(SHM_DIR, segment_name(params["engine_id"]).lstrip("/")))
    return report


def _child(params: dict) -> None:
    from shmtier.stress.chaos import Chaos, ChaosRunner
    from shmtier.stress.engine import Engine, Totals, play
    from shmtier.stress.invariants import CallTimer, Clock, check_rows
    from shmtier.stress.trace import Conversation, plan
    from shmtier.stress.verdict import StressResult

    p = params
    result, clock, totals = StressResult(), Clock(), Totals()
    timer = CallTimer(result, clock, p["call_bound_s"])
    queue = plan(p["conversations"], p["turns"], p["seed"])
    convs = [Conversation(c) for c in range(p["conversations"])]
    engine = Engine(p["extra"], p["engine_id"], p["gpu_blocks"], result, clock)
    engine.driver.settle(30.0, sleep_s=0.002)  # tier workers up and the fs root listed
    from shmtier.tiers.fs.namespace import namespace_dir_name

    runner = ChaosRunner(Chaos.from_dict(p["chaos"]), np.random.default_rng(p["seed"] + 1),
                         engine.pool, p["engine_id"], p["root"], len(queue), totals.counters,
                         timer, 0, p["stop"], p["filler"],
                         namespace=namespace_dir_name(engine.spec.fingerprint),
                         idle_step=engine.idle_step)
    play(engine, convs, queue, 0, p["stop"], chunks_per_turn=p["chunks_per_turn"],
         runner=runner, totals=totals, timer=timer, clock=clock, result=result,
         check_every=p["check_every"])
    runner.stop()
    pinned, pending = check_rows(p["engine_id"], engine.ledger, result, clock,
                                 engine.manager.lock)
    out = {"totals": totals.as_dict(), "steps": clock.step, "step_us": timer.step_us,
           "call_s": timer.call_s, "result": result.as_dict(), "chaos": runner.counts,
           "corrupted": runner.corrupted, "big": runner.big,
           "link_removed_at_end": runner.link_removed_at_end,
           "ledger": engine.ledger.counts(),
           "rows_at_kill": {"pinned": pinned, "pending": pending,
                            "resident": len(engine.manager.primary.resident_keys())},
           "pid": os.getpid()}
    sys.stdout.write(_PREFIX + json.dumps(out) + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # killed here, with its work in flight


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
