"""The tier worker pool's two lanes: which workers run at the engine's priority.

Imported by the scheduler process (``scheduler/pool/dispatch.py``: which workers take a
job's unbound keys), by every tier worker (``workers/job_loop.py``: which priority it
runs at) and by ``shmtier top`` (``shared/snapshot.py``). Pure functions of the pool
config's ``num_workers`` and ``promotion_workers``; imports nothing of shmtier's.

Of a pool's ``num_workers`` workers, the last ``promotion_workers`` form the
**promotion lane**: they keep the priority they inherit from the process that starts
them (the engine's scheduler, or ``shmtier workers`` in external mode) and run under
SCHED_OTHER, and they take the work a waiting request needs: loads (promotions) and
lookup probes (``PROMOTION_OPS``). The others form the **background lane** (niceness
+``tier_worker_niceness``, ``tier_worker_policy``): stores (cascades), deletes, scans.

Why processes and not a priority per job: an unprivileged process cannot lower its
niceness again (RLIMIT_NICE is 0 and containers drop CAP_SYS_NICE), and two priorities
in one Python process would invert through the GIL (a background thread holding it
stalls the urgent one). docs/architecture.md, "Tier worker lanes".
"""

from __future__ import annotations

BACKGROUND = "background"
PROMOTION = "promotion"
#: ops whose unbound keys go to the promotion lane: what a waiting request needs
PROMOTION_OPS = frozenset(("load", "probe"))


def default_promotion_workers(num_workers: int) -> int:
    """The ``tier_promotion_workers`` default: one when the pool has at least two workers
    (one left for the background lane), else none (a single worker stays background:
    a cascade at the engine's priority would preempt the scheduler thread)."""
    return 1 if num_workers >= 2 else 0


def first_promotion_worker(num_workers: int, promotion_workers: int) -> int:
    """Index of the first worker of the promotion lane (``num_workers`` when it is empty)."""
    return num_workers - promotion_workers


def worker_lane(index: int, num_workers: int, promotion_workers: int) -> str:
    """``PROMOTION`` or ``BACKGROUND``: the lane of worker slot ``index``."""
    return PROMOTION if index >= num_workers - promotion_workers else BACKGROUND
