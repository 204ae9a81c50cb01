"""The ``shmtier`` command: ``run``, ``demo``, ``workers``, ``segments``, ``clean``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shmtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="short multi-turn stress run: CPU tier + fs tier + workers")
    run.add_argument("--conversations", type=int, default=24)
    run.add_argument("--turns", type=int, default=4)
    run.add_argument("--chunks-per-turn", type=int, default=4)
    run.add_argument("--cpu-chunks", type=int, default=48)
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("--settle-each", action="store_true",
                     help="wait for the tiers after every request (deterministic counts)")
    run.add_argument("--seed", type=int, default=0, help="trace order and chaos choices")
    run.add_argument("--max-bytes", type=int, default=None, help="the fs tier's max_bytes")
    run.add_argument("--kill-workers-every", type=float, default=None, metavar="SECONDS",
                     help="SIGKILL a random healthy tier worker every SECONDS (0.5x-1.5x, random)")
    run.add_argument("--delete-namespace-at", type=float, action="append", default=[],
                     metavar="FRACTION", help="at this fraction of the trace remove everything "
                     "under the fs root (repeatable)")
    run.add_argument("--delete-root-at", type=float, action="append", default=[],
                     metavar="FRACTION", help="at this fraction of the trace remove the fs root "
                     "itself, and make it again --root-gone-s later (repeatable)")
    run.add_argument("--root-gone-s", type=float, default=1.0)
    demo = sub.add_parser("demo", help="offload and reload chunks through the CPU tier")
    demo.add_argument("--requests", type=int, default=12)
    demo.add_argument("--chunks-per-request", type=int, default=8)
    demo.add_argument("--cpu-mib", type=int, default=8, help="CPU tier size (MiB)")
    demo.add_argument("--blocks-per-chunk", type=int, default=4)
    demo.add_argument("--policy", default="lru")
    workers = sub.add_parser("workers", help="run the tier worker pool of a running engine "
                             "(its config sets \"workers\": \"external\")")
    workers.add_argument("--engine-id", required=True)
    workers.add_argument("--num-workers", type=int, default=None,
                         help="must match the engine's num_tier_workers (default: read it)")
    sub.add_parser("segments", help="list shmtier segments on this host")
    sub.add_parser("clean", help="remove segments whose owner process is dead")
    args = parser.parse_args(argv)

    if args.command == "run":
        from shmtier.stress import Chaos, run_stress

        chaos = None
        if args.kill_workers_every or args.delete_namespace_at or args.delete_root_at:
            chaos = Chaos(args.kill_workers_every, tuple(args.delete_namespace_at),
                          tuple(args.delete_root_at), args.root_gone_s)
        return run_stress(args.conversations, args.turns, args.chunks_per_turn, args.cpu_chunks,
                          args.workers, seed=args.seed, settle_each=args.settle_each,
                          chaos=chaos, max_bytes=args.max_bytes)
    if args.command == "demo":
        from shmtier.demo import run_demo

        return run_demo(args.requests, args.chunks_per_request, args.cpu_mib,
                        args.blocks_per_chunk, args.policy)
    if args.command == "workers":
        from shmtier.workers.external import run_external_pool

        return run_external_pool(args.engine_id, args.num_workers)
    from shmtier.shared.ring import clean_stale_ring_semaphores
    from shmtier.shared.segment import clean_stale_segments, list_segments

    if args.command == "segments":
        for s in list_segments():
            state = "live" if s.alive else "STALE"
            print(f"{s.name}  {s.size >> 20} MiB  owner {s.owner_pid or '-'}  "
                  f"creator {s.creator_pid}  {state}  {s.fingerprint}")
        return 0
    removed = clean_stale_segments() + clean_stale_ring_semaphores()
    print("\n".join(f"removed {name}" for name in removed) or "nothing stale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
