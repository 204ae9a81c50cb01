"""``shmtier bench``: one trace through shmtier's spec (its real tier worker processes)
and, when vLLM is importable, through the installed vLLM's own tiering manager with its
fs tier (0.33 or 0.34: which one, and how its connector's calls are replayed, is
``baseline.py``'s), the same capacity, runs alternated (``--repeats``); every loaded
chunk checked byte for byte; this machine's limits measured in the same run; a JSON
report, a Markdown summary and PNG plots (matplotlib, if importable) under ``--out``.

The parts: ``trace.py`` (generators, JSON lines), ``baseline.py`` (the vLLM baseline: its
version and its connector's calls), ``managers.py`` (both managers, built the same size),
``driver.py`` (one run: the connector's scheduler-side call sequence, timed),
``report.py`` (per-run summary, the tables), ``limits.py``, ``output.py`` (JSON, Markdown,
plots), ``busy.py`` (``--busy N``: processes spinning at niceness 0 through every run, a
busy host; the machine's limits are measured before they start). bench/tiering_steps.py
is the same driver with the longer text tables.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time

# the bench's machinery (numpy, the managers) is imported by run_bench, not by the CLI's
# argument parsing: `shmtier ls` and friends do not pay for it
GENERATORS = ("chat", "docqa", "agent")  # shmtier.bench.trace.GENERATORS


def add_arguments(p) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="seconds: a small trace, 1 run per manager, small CPU tier")
    size.add_argument("--soak", action="store_true",
                      help="tens of minutes: a long trace (60k requests per run)")
    size.add_argument("--long", action="store_true",
                      help="issue 29's long run, minutes: a chat trace of 600 requests and "
                      "10.9 GiB of distinct KV, 1408 KiB chunks, 1 GiB CPU tier (~2 min a run; "
                      "bench/README.md, 'Cost per byte over a long run')")
    p.add_argument("--workload", default="chat", choices=GENERATORS,
                   help="seeded generator: chat (multi-turn chat), docqa (long documents, many "
                   "readers), agent (agentic loops with branching); default chat")
    p.add_argument("--trace", metavar="FILE", help="replay a JSON-lines trace instead (schema: "
                   "bench/README.md, 'shmtier bench'; python -m shmtier.bench.trace --write makes one)")
    p.add_argument("--write-trace", metavar="FILE", help="also write the trace as JSON lines")
    p.add_argument("--requests", type=int, default=None, help="override the generator's size")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per manager, alternated (default 3; 1 with --quick)")
    p.add_argument("--managers", default="shmtier,vllm",
                   help="comma-separated: shmtier, vllm (dropped with a note when vLLM is not "
                   "importable), shmtier@TOKENS variants as in bench/tiering_steps.py")
    p.add_argument("--no-vllm", action="store_true", help="measure shmtier alone")
    p.add_argument("--chunk-kib", type=int, default=None,
                   help="chunk (arena row) KiB (default 256; 1408 with --long)")
    p.add_argument("--cpu-mib", type=int, default=None,
                   help="CPU tier MiB (default 128; 32 quick, 1024 long)")
    p.add_argument("--step-ms", type=float, default=None,
                   help="engine step period; the simulated forward pass sleeps the rest "
                   "(default 5; 2 quick)")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="chunks a running request offers per step")
    p.add_argument("--workers", type=int, default=2, help="shmtier num_tier_workers")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="a busy host: N processes spinning at niceness 0 from before the "
                   "first run to after the last, the same for every manager (default 0)")
    p.add_argument("--compression", default=None, choices=("auto", "zstd", "none"),
                   help="shmtier's compression (default: its default)")
    p.add_argument("--dir", default=None, help="parent of the fs tiers' temp dirs and of the "
                   "disk limit's file (default: the system temp dir)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the report goes (default ./shmtier-bench-<time>)")
    p.add_argument("--no-plots", action="store_true", help="no PNG plots")
    p.add_argument("--no-limits", action="store_true", help="do not measure the machine's limits")
    p.add_argument("--stress", action="store_true",
                   help="stress mode instead: sustained load with fault injection and "
                   "invariants checked, a pass/fail verdict (see shmtier run)")


def label(name: str) -> str:  # replaced by report.label once run_bench imported it
    return name


class Progress:
    """One progress line on stderr for runs longer than a couple of seconds: rewritten in
    place on a terminal, else a line every 10 s."""

    def __init__(self, total_runs: int) -> None:
        self.total = total_runs
        self.tty = sys.stderr.isatty()
        self.run_no, self.name, self.t0, self.last = 0, "", 0.0, 0.0

    def start(self, run_no: int, name: str) -> None:
        self.run_no, self.name, self.t0 = run_no, name, time.monotonic()
        self.last = self.t0

    def __call__(self, fraction: float) -> None:
        now = time.monotonic()
        if now - self.t0 < 2 or now - self.last < (0.5 if self.tty else 10):
            return
        self.last = now
        eta = (now - self.t0) * (1 - fraction) / max(fraction, 1e-3)
        width = 30
        bar = "#" * int(width * fraction) + "-" * (width - int(width * fraction))
        text = (f"run {self.run_no}/{self.total} {label(self.name):>10} [{bar}] "
                f"{fraction * 100:3.0f}%  {now - self.t0:5.0f} s, ~{eta:.0f} s left")
        sys.stderr.write(("\r" + text) if self.tty else text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and time.monotonic() - self.t0 >= 2:
            sys.stderr.write("\r" + " " * 90 + "\r")
            sys.stderr.flush()


def run_bench(args) -> int:
    global label
    from shmtier.bench import baseline
    from shmtier.bench import limits as bench_limits
    from shmtier.bench import trace as bench_trace
    from shmtier.bench.busy import BusyHost
    from shmtier.bench.common import exit_through_finally, rotated
    from shmtier.bench.driver import Config, make_data_pool, run_once_more_on_stall
    from shmtier.bench.output import extend_summary, write_reports
    from shmtier.bench.report import label, summarise

    if args.busy < 0:
        print(f"shmtier bench: --busy {args.busy}: expected a number of processes >= 0",
              file=sys.stderr)
        return 2
    if args.stress:
        if args.busy:
            print("shmtier bench: --busy is for the side-by-side runs, not --stress",
                  file=sys.stderr)
            return 2
        from shmtier.bench.stress import run_stress_bench

        return run_stress_bench(args)
    size = ("quick" if args.quick else "soak" if args.soak else "long" if args.long
            else "default")
    if args.long and (args.trace or args.workload != "chat"):
        print("shmtier bench: --long is a chat trace of its own: not with --trace or --workload",
              file=sys.stderr)
        return 2
    preset = bench_trace.LONG_RUN if args.long else {"chunk_kib": 256, "cpu_mib": 128,
                                                       "step_ms": 5.0}
    repeats = args.repeats or (1 if args.quick else 3)
    cpu_mib = args.cpu_mib or (32 if args.quick else preset["cpu_mib"])
    step_ms = args.step_ms if args.step_ms is not None else (2.0 if args.quick
                                                             else preset["step_ms"])
    args.chunk_kib = args.chunk_kib or preset["chunk_kib"]
    chunk_bytes = args.chunk_kib * 1024
    if chunk_bytes % 4096 or chunk_bytes <= 0:
        print("shmtier bench: --chunk-kib must be a positive multiple of 4", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.managers.split(",") if n.strip()]
    if args.no_vllm and "vllm" in names:
        names.remove("vllm")
    from shmtier.bench.managers import known_manager

    for n in names:
        if not known_manager(n) or names.count(n) > 1:
            print(f"shmtier bench: bad --managers entry {n!r}", file=sys.stderr)
            return 2
    if not names:
        print("shmtier bench: no manager to run", file=sys.stderr)
        return 2
    out_dir = args.out or os.path.abspath(time.strftime("shmtier-bench-%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    work_dir = args.dir or tempfile.gettempdir()
    exit_through_finally()

    connector, vllm_note = baseline.load("vllm" in names)
    if connector.baseline is None and "vllm" in names:
        names.remove("vllm")
    t0 = time.perf_counter()
    try:
        if args.trace:
            trace = bench_trace.read_jsonl(args.trace)
        else:
            trace = bench_trace.generate(args.workload, size, args.seed, requests=args.requests)
    except (OSError, ValueError) as e:
        print(f"shmtier bench: {e}", file=sys.stderr)
        return 2
    gen_s = time.perf_counter() - t0
    if args.write_trace:
        bench_trace.write_jsonl(trace, args.write_trace)
    capacity = (cpu_mib << 20) // chunk_bytes
    print(f"shmtier bench: {', '.join(label(n) for n in names)}; {vllm_note}")
    print(f"  trace: {trace.describe(capacity)} ({'read' if args.trace else 'generated'} in "
          f"{gen_s:.2f} s)")
    print(f"  chunk {args.chunk_kib} KiB, CPU tier {cpu_mib} MiB ({capacity} chunks), fs tier "
          f"under {work_dir}, step {step_ms:g} ms, {repeats} run(s) per manager alternated, "
          f"{args.busy or 'no'} busy process(es) at niceness 0; report in {out_dir}", flush=True)

    limits = None
    if not args.no_limits:
        limits = bench_limits.measure(work_dir, chunk_bytes, quick=args.quick)
        print(f"  this machine: memcpy {limits['memcpy_gbps']:.1f} GB/s, codec "
              f"{limits['codec_encode_gbps_per_core']:.2f}/{limits['codec_decode_gbps_per_core']:.2f}"
              f" GB/s per core (encode/decode), disk {limits['disk_write_gbps']:.2f}/"
              f"{limits['disk_read_gbps']:.2f} GB/s (write/read), measured in "
              f"{limits['measured_in_s']:.1f} s", flush=True)

    progress = Progress(repeats * len(names))
    cfg = Config(chunk_bytes=chunk_bytes, cpu_bytes=cpu_mib << 20, step_ms=step_ms,
                 max_running=args.max_running, batch=args.batch, workers=args.workers,
                 dir=work_dir, compression=args.compression, samples=60, progress=progress,
                 connector=connector)
    data_pool = make_data_pool(chunk_bytes, 16, args.seed)
    meta = {"bench": "shmtier bench", "size": size, "repeats": repeats, "managers": names,
            "vllm": vllm_note, "baseline": connector.as_dict(), "trace": trace.summary(),
            "trace_text": trace.describe(capacity),
            "trace_file": args.trace, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_avg_start": os.getloadavg()[0], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "config": {"chunk_bytes": chunk_bytes, "cpu_mib": cpu_mib, "capacity_chunks": capacity,
                       "step_ms": step_ms, "max_running": args.max_running, "batch": args.batch,
                       "workers": args.workers, "compression": args.compression,
                       "dir": work_dir, "seed": args.seed, "busy": args.busy}}
    sums = {n: [] for n in names}
    raws = {n: [] for n in names}
    run_no = 0
    stalls: list[dict] = []  # runs that made no progress (each run again once)
    with BusyHost(args.busy) as busy:
        if args.busy:
            print(f"  {busy.describe()}", flush=True)
        meta["busy"] = busy.as_dict()
        for r in range(repeats):
            for n in rotated(names, r):
                progress.start(run_no + 1, n)
                res, run_no = run_once_more_on_stall(n, trace, cfg, data_pool, run_no + 1,
                                                     stalls)
                progress.done()
                s = extend_summary(summarise(res, chunk_bytes), res, chunk_bytes, limits)
                sums[n].append(s)
                raws[n].append(res)
                print(f"  run {r + 1}/{repeats} {label(n):>10}: {s['steps']} steps, step p50 "
                      f"{s['step_us_p50']:.0f} µs p99 {s['step_us_p99']:.0f} µs, hits CPU "
                      f"{s['hit_cpu']:.2f} fs {s['hit_fs']:.2f}, {s['verified']} loaded chunks "
                      f"checked, {s['wrong_kv']} wrong, wall {s['wall_s']:.1f} s"
                      + (f", {s['abandoned']} request(s) given up (self-eviction)"
                         if s["abandoned"] else ""), flush=True)
    meta["load_avg_end"] = os.getloadavg()[0]
    meta["stalls"] = stalls  # in report.json: runs that made no progress and were run again
    report = write_reports(out_dir, meta, limits, sums, raws, plots=not args.no_plots)
    print(f"  verification: {report['verification']['text']}")
    for line in report["ratio_lines"]:
        print(f"  {line}")
    print(f"  plots: {report['plots_text']}")
    print(f"wrote {os.path.join(out_dir, 'report.json')} and report.md")
    return 0 if report["verification"]["passed"] else 1
