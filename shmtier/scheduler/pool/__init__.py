"""The tier worker pool's supervisor: runs in the scheduler process.

``WorkerPool`` starts (or, in external mode, watches) the tier worker processes
and moves jobs to them and results back over the rings in the segment. The
workers' own code is ``shmtier.workers``.
"""

from shmtier.scheduler.pool.supervisor import PoolResult, WorkerPool

__all__ = ["PoolResult", "WorkerPool"]
