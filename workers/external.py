"""``shmtier workers --engine-id ID``: run an engine's tier workers from outside.

Runs in: a standalone supervisor process (not the engine). It reads the pool
config the engine published in its segment, starts one worker process per slot
(``python -m shmtier.workers.job_loop ID i``), and restarts a worker that
died — but only after the engine's pool has recovered its slot (the holder
is cleared), so every job the dead worker held is failed exactly once by the
engine before a replacement takes new ones. Exits when the engine's segment
owner is gone or on SIGINT/SIGTERM (stopping its workers). With ``metrics_port`` it also
serves the workers' Prometheus metrics (``metrics.py``).

Lanes (``shared/lanes.py``): each worker sets its own priority from its index and the
pool config; the promotion lane's workers keep the niceness they inherit from this
process, so run ``shmtier workers`` at the engine's niceness. The start-up line names
the lanes.

One pool per engine (every ring has one consumer): it refuses, with exit code
2 and touching nothing, an engine whose pool runs in spawn mode (the scheduler
starts its own workers) or whose worker slots are held by live processes
(another ``shmtier workers`` serves it).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from shmtier.shared.lanes import PROMOTION, worker_lane
from shmtier.shared.pool_config import PoolConfig
from shmtier.shared.ring import RingSet
from shmtier.shared.segment import join_existing


def lanes_text(config: PoolConfig) -> str:
    """The pool's lanes in words: which slots run at this process's niceness."""
    n, k = config.options.num_tier_workers, config.options.promotion_workers
    promotion = [i for i in range(n) if worker_lane(i, n, k) == PROMOTION]
    if not promotion:
        return "all in the background lane"
    return (f"promotion lane: worker{'s' if len(promotion) > 1 else ''} "
            f"{', '.join(map(str, promotion))} at this process's "
            f"niceness; background lane: the others at +{config.options.tier_worker_niceness}")


def run_external_pool(engine_id: str, num_workers: int | None = None, *,
                      metrics_port: int | None = None, metrics_addr: str = "127.0.0.1") -> int:
    segment = join_existing(engine_id)
    rings = server = None
    procs: list[subprocess.Popen | None] = []
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        config = PoolConfig.read(segment.rings)
        if num_workers is not None and num_workers != config.options.num_tier_workers:
            print(f"shmtier workers: --num-workers {num_workers} does not match the engine's "
                  f"num_tier_workers {config.options.num_tier_workers}", file=sys.stderr)
            return 2
        if config.options.workers != "external":
            print(f"shmtier workers: engine {engine_id!r} runs its own tier workers (its pool "
                  f"is in {config.options.workers} mode); set \"workers\": \"external\" in its config to "
                  f"run them with `shmtier workers`", file=sys.stderr)
            return 2
        rings = RingSet.attach(segment.name, segment.rings)
        held = [f"slot {i}: pid {rings.worker(i).last_beat().pid}"
                for i in range(config.options.num_tier_workers) if rings.worker(i).holder_alive()]
        if held:
            print(f"shmtier workers: the tier worker slots of engine {engine_id!r} are held by "
                  f"live processes ({', '.join(held)}): another worker pool serves it; not "
                  f"starting a second one", file=sys.stderr)
            return 2

        def start(i: int) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "shmtier.workers.job_loop", engine_id, str(i)],
                                    stdin=subprocess.DEVNULL)

        if metrics_port is not None:
            from shmtier.workers.metrics import serve

            try:
                server, port = serve(engine_id, segment.rings, metrics_port, metrics_addr)
            except OSError as e:
                print(f"shmtier workers: cannot serve metrics on {metrics_addr}:{metrics_port}: "
                      f"{e.strerror or e}", file=sys.stderr)
                return 2
            print(f"shmtier workers: metrics on http://{metrics_addr}:{port}/metrics",
                  flush=True)
        procs = [start(i) for i in range(config.options.num_tier_workers)]
        print(f"shmtier workers: {config.options.num_tier_workers} tier workers serving "
              f"{segment.name} ({lanes_text(config)})", flush=True)
        while not stopping and segment.header().owner_alive():
            for i, proc in enumerate(procs):
                if proc is not None and proc.poll() is not None:
                    procs[i] = None  # dead: wait for the engine to recover its slot
                if procs[i] is None and rings.worker(i).last_beat().pid == 0:
                    procs[i] = start(i)
            time.sleep(0.1)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if server is not None:  # before the ring area's view goes
            server.shutdown()
            server.server_close()
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in procs:
            if proc is not None:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if rings is not None:
            rings.close()
        segment.close()
