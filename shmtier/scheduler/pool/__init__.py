"""The tier worker pool's supervisor: runs in the scheduler process.

``WorkerPool`` (``supervisor.py``) starts the tier worker processes (or, in
external mode, watches those ``shmtier workers`` runs) and moves jobs to them
and results back over the rings in the segment; ``dispatch.py`` keeps the jobs'
bookkeeping, ``worker_state.py`` each worker slot's state machine,
``old_holders.py`` the slots a previous scheduler's workers still hold when a pool
starts (a warm restart). The workers' own code is ``shmtier.workers``.
"""

from shmtier.scheduler.pool.dispatch import PoolJobId, PoolResult
from shmtier.scheduler.pool.supervisor import MODES, WorkerPool
from shmtier.scheduler.pool.worker_state import WorkerState

__all__ = ["MODES", "PoolJobId", "PoolResult", "WorkerPool", "WorkerState"]
