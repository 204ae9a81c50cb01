"""Worker slots still held by a previous scheduler's tier workers: wait them out, or kill them.

Who calls: ``WorkerPool.__init__``, in the scheduler process, after the segment was
claimed (``Segment.claim_ownership`` bumped the owner generation) and before the pool
writes its config and re-creates the rings (``RingSet.create`` zeroes every slot's holder
record and replaces the semaphores). Blocks: up to ``grace_s``, then up to
``kill_wait_s`` for what it killed to be gone; returns at once when no slot is held (a
new segment, or a predecessor whose workers are gone).

Why: a scheduler that re-attaches to a dead one's segment (``warm_restart``) may come
before that one's tier workers have left. Each of them would keep serving its slot beside
the worker the new pool starts there: a job taken twice, results put into rings it no
longer owns, heartbeats and counters mixed, a row written for a job nobody waits for. Such
a worker exits by itself once it sees the owner generation changed (``workers/job_loop.py``:
at its next wake-up, at most one heartbeat interval, or after the slice of a job in hand),
answering nothing. A live holder found here is provably such a worker: the rings of the
area were made by an earlier pool (this one has made none yet, and ``shmtier workers``
attaches only to rings whose creator runs), and the owner generation has moved on.

Rule: read each slot's holder (pid and start time) once; wait up to ``grace_s`` for each
to be gone; SIGKILL those still running (verified by pid and start time first, so a reused
pid is never signalled) and wait up to ``kill_wait_s`` more. A holder still alive then (a
process in uninterruptible sleep) raises ``RuntimeError`` naming it: the new pool never
runs beside an old worker.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from shmtier.shared import procinfo
from shmtier.shared.ring_tools import inspect_area

#: How long the previous scheduler's workers get to see the new owner generation and leave
#: by themselves (each looks at least every heartbeat interval, 0.25 s by default).
GRACE_S = 2.0
KILL_WAIT_S = 5.0
_POLL_S = 0.01


@dataclass(frozen=True)
class OldHolder:
    """A previous scheduler's worker found holding slot ``slot``: whether it had to be
    killed, and how long after the pool started looking it was gone."""

    slot: int
    pid: int
    killed: bool
    gone_after_s: float


def retire_old_holders(region, *, grace_s: float = GRACE_S,
                       kill_wait_s: float = KILL_WAIT_S) -> list[OldHolder]:
    """Make sure no process holds a worker slot of the ring area ``region`` (the segment's
    ring area, before the pool re-creates the rings); returns the holders found, by slot."""
    area = inspect_area(region)
    if area is None:
        return []
    held = [(s.index, s.heartbeat.pid, s.heartbeat.start_time)
            for s in area.workers if s.holder_alive]
    if not held:
        return []
    boot = procinfo.boot_id()
    started = time.monotonic()
    gone_after: dict[int, float] = {}

    def wait_until(deadline: float) -> None:
        while True:
            now = time.monotonic()
            for slot, pid, start in held:
                if slot not in gone_after and not procinfo.is_alive(pid, start, boot):
                    gone_after[slot] = now - started
            if len(gone_after) == len(held) or now >= deadline:
                return
            time.sleep(_POLL_S)

    wait_until(started + grace_s)
    killed = set()
    for slot, pid, start in held:
        if slot not in gone_after and procinfo.is_alive(pid, start, boot):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(slot)
            except ProcessLookupError:
                pass
    if len(gone_after) < len(held):
        wait_until(time.monotonic() + kill_wait_s)
    left = [f"slot {slot}: pid {pid}" for slot, pid, _ in held if slot not in gone_after]
    if left:
        raise RuntimeError(
            f"tier worker slots still held by the previous scheduler's workers "
            f"{kill_wait_s:g} s after SIGKILL ({', '.join(left)}); not starting a pool "
            f"beside them")
    return [OldHolder(slot, pid, slot in killed, gone_after[slot]) for slot, pid, _ in held]
