"""``shmtier run`` (what ``scripts/run`` runs) and ``shmtier bench --stress``: a multi-turn
stress run under fault injection, ending in a verdict.

One process plays the scheduler and a GPU rank (CPU tensors stand in for the GPU KV
cache); the spec spawns the tier worker processes that cascade chunks to an ``fs`` tier
in a temporary directory and promote them back. The CPU tier holds a fraction of the
working set, so later turns find their prefix on disk.

Faults (``Chaos``, ``chaos.py``): SIGKILL random tier workers, remove the fs namespace or
the root, damage random chunk files, replace chunk files by sparse files over 4 GiB, put a
symbolic link in the namespace directory's place while a tier worker restarts, fill the
root's filesystem (a tmpfs mounted for the run), SIGSTOP a tier worker past the pool's
heartbeat timeout, SIGKILL the scheduler and warm-restart it on its segment
(``restart.py``).

Invariants checked while the load runs (``invariants.py``): no wrong byte served (every
loaded chunk compared), rows pinned and pending equal the keys of the jobs in flight,
every job submitted to the fs tier and to the worker pool completes exactly once, every
manager call under a bound (p99 and max reported). A violation records its step. At the
end (``checks.py``): the tiers settle; the fs index equals the files and the bytes gauge;
the damaged files the tier never read again are exactly what ``shmtier fsck --verify``
finds; a fresh engine's scan of the root agrees, and no file too big for a chunk is left
by then; tier workers restarted under a namespace link start, and stores resume once it is
gone; nothing is left in /dev/shm.

Modules: ``trace`` (keys and bytes), ``engine`` (one scheduler process's engine and the
request loop), ``chaos`` and ``faults`` (what is done to the tiers), ``invariants``,
``checks``, ``restart``, ``verdict`` (``StressResult``), ``run`` (``run_stress``).
"""

from shmtier.stress.chaos import Chaos
from shmtier.stress.run import run_stress
from shmtier.stress.verdict import StressResult

__all__ = ["Chaos", "StressResult", "run_stress"]
