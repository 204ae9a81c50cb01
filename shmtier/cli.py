"""The ``shmtier`` command: ``run``, ``demo``, ``workers``, ``ls`` (``segments``), ``top``,
``fsck``, ``clean``, ``bench``. Exit codes: 0 success, 1 problems found (``fsck``, a
failed ``bench`` verification or stress verdict), 2 usage or I/O error."""

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
    run.add_argument("--corrupt-at", type=float, action="append", default=[],
                     metavar="FRACTION", help="at this fraction of the trace damage "
                     "--corrupt-files random chunk files (flip, truncate, header; repeatable)")
    run.add_argument("--corrupt-files", type=int, default=4)
    run.add_argument("--fill-root-at", type=float, default=None, metavar="FRACTION",
                     help="put the fs root on a tmpfs (mounted for the run; needs root) and "
                     "fill it at this fraction of the trace, for --fill-for of it")
    run.add_argument("--fill-for", type=float, default=0.15, metavar="FRACTION")
    run.add_argument("--stall-at", type=float, action="append", default=[],
                     metavar="FRACTION", help="at this fraction of the trace SIGSTOP a tier "
                     "worker for --stall-s, then SIGCONT (repeatable)")
    run.add_argument("--stall-s", type=float, default=3.0)
    run.add_argument("--warm-restart-at", type=float, default=None, metavar="FRACTION",
                     help="play the trace up to this fraction in a scheduler process, SIGKILL "
                     "it, and go on in a new one with warm_restart")
    run.add_argument("--check-every", type=int, default=8, metavar="STEPS",
                     help="steps between checks of rows and pins against the jobs in flight")
    run.add_argument("--call-bound-ms", type=float, default=500.0,
                     help="the most one manager call may take (a violation above)")
    demo = sub.add_parser("demo", help="offload and reload chunks through the CPU tier")
    demo.add_argument("--requests", type=int, default=12)
    demo.add_argument("--chunks-per-request", type=int, default=8)
    demo.add_argument("--cpu-mib", type=int, default=8, help="CPU tier size (MiB)")
    demo.add_argument("--blocks-per-chunk", type=int, default=4)
    demo.add_argument("--policy", default="lru")
    workers = sub.add_parser("workers", help="run the tier worker pool of a running engine "
                             "(its config sets \"workers\": \"external\")",
                             description="Run the tier worker pool of a running engine whose "
                             "config sets \"workers\": \"external\". Exit codes: 0 stopped "
                             "(SIGTERM, Ctrl-C, the engine gone), 2 refused (another pool "
                             "serves it, spawn mode, --num-workers mismatch).")
    workers.add_argument("--engine-id", required=True)
    workers.add_argument("--num-workers", type=int, default=None,
                         help="must match the engine's num_tier_workers (default: read it)")
    workers.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                         help="serve Prometheus metrics of the workers on this port "
                         "(0: any free port, printed)")
    workers.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                         help="address the metrics endpoint binds (default 127.0.0.1)")
    for name, aliases in (("ls", ["segments"]),):
        ls = sub.add_parser(name, aliases=aliases,
                            help="list shmtier segments on this host (alias: segments)",
                            description="List shmtier segments on this host: owner alive "
                            "or stale, geometry, rows used, tier workers, tiers; then what "
                            "tiers keep beside them (node pools: the engines using each, "
                            "their hit rates). Exit code 0.")
        ls.add_argument("--json", action="store_true", help="print JSON")
        ls.add_argument("--host", action="store_true",
                        help="only what tiers keep on the host beside the segments (node "
                        "pools, each with the engines using it); with --json an object "
                        "keyed by tier type (\"node\": a list of pools)")
    top = sub.add_parser("top", help="live view of one engine's segment (read-only)",
                         description="A live view of one engine's segment: rows by state, "
                         "tiers, tier workers (heartbeats, restarts, counters, ring depths, "
                         "jobs/s and GB/s). Read-only: no lock, no semaphore, no write. "
                         "Exit codes: 0, 2 no such segment.")
    top.add_argument("engine_id", metavar="ENGINE_ID", help="engine id (or segment name)")
    top.add_argument("--once", action="store_true",
                     help="print one frame and exit (two samples --interval apart)")
    top.add_argument("--json", action="store_true",
                     help="print JSON (one object per frame; one per line when live)")
    top.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                     help="refresh period (default 1)")
    top.add_argument("--iterations", type=int, default=None, metavar="N",
                     help="exit after N frames")
    from shmtier.tiers import registry

    fsck_tools = registry.fsck_tools()
    targets = " or ".join(t.target for t in fsck_tools if t.target)
    fsck = sub.add_parser(
        "fsck", help=f"check (and repair) {targets}",
        description=f"Check every shmtier namespace in {targets}: chunks and bytes per "
        "namespace, corrupt and truncated chunks, foreign files, orphaned temp files of "
        "dead writers, chunks in the wrong fan-out directory, links. Safe while engines "
        "use it; never follows a link and never touches anything outside the namespaces. "
        "Exit codes: 0 clean (or all repaired), 1 problems left, 2 usage or I/O error.")
    fsck.add_argument("--verify", action="store_true",
                      help="decode every chunk (all CRCs; the MAC with --mac-key-file), "
                      "not only its header")
    fsck.add_argument("--repair", action="store_true", help="remove what is bad")
    fsck.add_argument("--json", action="store_true", help="print JSON")
    fsck.add_argument("--mac-key-file", metavar="FILE",
                      help="the tiers' MAC key (checks the tags of its namespace)")
    for tool in fsck_tools:
        tool.add_arguments(fsck)
    cleaned = ", ".join(t.clean_what for t in fsck_tools if t.clean_what)
    clean = sub.add_parser("clean", help="remove segments and semaphores of dead owners"
                           + (f" (and, {cleaned})" if cleaned else ""),
                           description="Remove shmtier segments and ring semaphores whose "
                           "owner process is dead" + (f" (and, {cleaned})" if cleaned else "")
                           + ". Exit codes: 0, 2 a target to clean unusable.")
    clean.add_argument("engine_ids", nargs="*", metavar="ENGINE_ID",
                       help="only these engines' segments and semaphores (default: all)")
    for tool in fsck_tools:
        tool.add_clean_arguments(clean)
    bench = sub.add_parser(
        "bench", help="benchmark shmtier against vLLM 0.33's tiering on a trace; a report",
        description="Drive the connector's scheduler-side call sequence over a trace (seeded "
        "generator or a JSON-lines file) through shmtier's spec with its tier workers and, "
        "when vLLM is importable, vLLM 0.33's own tiering manager, the same capacity, runs "
        "alternated; every loaded chunk checked byte for byte. Writes report.json, report.md "
        "and PNG plots (matplotlib) under --out. Exit codes: 0 verified, 1 a wrong byte "
        "served (or a failed stress verdict), 2 usage error.")
    from shmtier.bench.run import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)

    if args.command == "run":
        from shmtier.stress import Chaos, run_stress

        try:
            chaos = Chaos(kill_every_s=args.kill_workers_every,
                          delete_namespace_at=tuple(args.delete_namespace_at),
                          delete_root_at=tuple(args.delete_root_at),
                          root_gone_s=args.root_gone_s, corrupt_at=tuple(args.corrupt_at),
                          corrupt_files=args.corrupt_files, fill_root_at=args.fill_root_at,
                          fill_for=args.fill_for, stall_at=tuple(args.stall_at),
                          stall_s=args.stall_s, warm_restart_at=args.warm_restart_at)
            return run_stress(args.conversations, args.turns, args.chunks_per_turn,
                              args.cpu_chunks, args.workers, seed=args.seed,
                              settle_each=args.settle_each, chaos=chaos,
                              max_bytes=args.max_bytes, check_every=args.check_every,
                              call_bound_s=args.call_bound_ms / 1e3)
        except ValueError as e:
            print(f"shmtier run: {e}", file=sys.stderr)
            return 2
    if args.command == "demo":
        from shmtier.demo import run_demo

        return run_demo(args.requests, args.chunks_per_request, args.cpu_mib,
                        args.blocks_per_chunk, args.policy)
    if args.command == "workers":
        from shmtier.workers.external import run_external_pool

        return run_external_pool(args.engine_id, args.num_workers,
                                 metrics_port=args.metrics_port, metrics_addr=args.metrics_addr)
    if args.command in ("ls", "segments"):
        from shmtier.top import run_ls

        return run_ls(args.json, host=args.host)
    if args.command == "top":
        from shmtier.top import run_top

        return run_top(args.engine_id, once=args.once, as_json=args.json,
                       interval=args.interval, iterations=args.iterations)
    if args.command == "fsck":
        return _fsck(args, fsck_tools)
    if args.command == "bench":
        from shmtier.bench.run import run_bench

        return run_bench(args)
    return _clean(args, fsck_tools)


def _fsck(args, tools: list) -> int:
    """``shmtier fsck``: the one tier whose target ``args`` name checks it."""
    import json

    from shmtier.tiers.commands import read_mac_key
    from shmtier.storage.fsck import EXIT_USAGE, FsckError

    chosen = [t for t in tools if t.chosen(args)]
    if len(chosen) != 1:
        print(f"shmtier fsck: give {', or '.join(t.usage for t in tools if t.usage)} (one of "
              "them)",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        mac_key = read_mac_key(args.mac_key_file) if args.mac_key_file else None
        report = chosen[0].run(args, mac_key)
    except (FsckError, ValueError, OSError) as e:
        print(f"shmtier fsck: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # e.g. ConfigError: boto3 missing, a bad tier config
        print(f"shmtier fsck: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return report.exit_code


def _clean(args, tools: list) -> int:
    """``shmtier clean``: stale segments and semaphores, then each tier's part."""
    from shmtier.shared.ring_tools import clean_stale_ring_semaphores
    from shmtier.shared.segment_tools import clean_stale_segments
    from shmtier.shared.snapshot import resolve

    names = {resolve(e) for e in args.engine_ids} if args.engine_ids else None
    removed = clean_stale_segments(names) + clean_stale_ring_semaphores(names)
    lines = [f"removed {name}" for name in removed]
    code = 0
    for tool in tools:
        more, tool_code = tool.clean(args)
        lines += more
        code = max(code, tool_code)
    print("\n".join(lines) or "nothing stale")
    return code


if __name__ == "__main__":
    sys.exit(main())
