#!/usr/bin/env python
"""Scheduler-side cost of tiering per engine step: shmtier vs vLLM (0.33 or 0.34), same trace.

Run from a checkout::

    .venv/bin/python -m bench.tiering_steps                 # 3 interleaved runs per manager (~75 s)
    .venv/bin/python -m bench.tiering_steps --quick         # smoke test: 1 small run each (~15 s)
    .venv/bin/python -m bench.tiering_steps --repeats 5 --json bench/results/tiering_steps.json
    .venv/bin/python -m bench.tiering_steps --managers shmtier,shmtier@nice0,shmtier@raw,vllm
    .venv/bin/python -m bench.tiering_steps --profile shmtier    # cProfile one run instead
    nice -n 0 .venv/bin/python -m bench.tiering_steps --busy 1   # a busy host (issue 29)
    nice -n 0 .venv/bin/python -m bench.tiering_steps --long     # ~11 GiB cascaded, ~2 min a run

Two managers, built the same size (CPU tier bytes, chunk bytes) with an ``fs``
secondary tier on a fresh temp directory each run (unbounded), are driven by the
same driver on the same trace (shmtier/bench/trace.py; multi-turn chat unless
``--workload docqa`` or ``agent``):

* ``shmtier``: ``shmtier.spec.TieringOffloadingSpec(...).get_manager()`` - primary
  tier in one POSIX shm segment, fs tier I/O and compression in tier worker
  processes (``num_tier_workers``);
* ``vllm``: the installed vLLM's (0.33 or 0.34) own ``TieringOffloadingManager`` with its
  ``CPUPrimaryTierOffloadingManager`` over a ``SharedOffloadRegion`` and its
  ``FileSystemTierManager`` (thread pool and async-lookup thread in this process),
  built from the real classes; the fs tier gets a minimal stand-in for the
  ``OffloadingSpec`` with exactly the attributes it reads (``config`` fields for
  its FileMapper namespace, ``blocks_per_chunk``, ``kv_events_config``).

The driver plays the OffloadingConnector's scheduler half (docs/vllm-contract.md §2.3) of
the installed vLLM's line (0.33 or 0.34; where they differ, shmtier/bench/baseline.py; the
same calls for every manager; without vLLM, 0.34's), once per step, with
``manager.lock`` held: admit waiting requests (``on_new_request`` once, then a
lookup scan over the prefix after the GPU-cached chunks until MISS; HIT_PENDING or RETRY defers the request to the next step, RETRY does not stop the
scan; hits -> ``prepare_load`` + ``get_load_source`` per loaded key); every
running request offers its next chunks to ``prepare_store`` (the driver then
writes the rows, standing in for the GPU copy; its read of the spec's ``block_ids`` is
not timed, for either manager: vLLM's spec builds that array in ``prepare_store``,
shmtier's on that first read, as a GPU worker's copy would); finished requests ->
``on_request_finished``; ``on_schedule_end``. Then the "forward pass" (a sleep),
then ``update_connector_output``: jobs prepared the step before complete
(``complete_store`` / ``complete_load``), then ``has_pending_work``,
``get_stats`` and ``take_events``. Every manager call is timed with
``perf_counter_ns`` (and ``thread_time_ns``, its on-CPU part); their sum is the
step's scheduler-thread time. The process's CPU over the run is reported twice: in the
manager (the main thread's CPU inside its calls + every other thread: issue 14's
scheduler-process CPU goal) and for the whole process, the driver's own work included
(shmtier/bench/report.py ``spec_cpu``).

Variants ``shmtier@TOKENS`` (interleaved with the others) change what shmtier's
tier workers run with after they start: scheduling (``nice0``, ``batch0``, ...,
see --worker-sched), compression (``raw`` = none, ``zstd``, ``zauto`` = auto), the fs tier's
``direct_io`` (``dio``: "writes", O_DIRECT stores; ``dioauto``: "auto", both ways;
``buffered``: false), the fs tier's
lookup probes of unknown keys (``noprobe``: off, the behaviour before shared roots), the
step-window poll thread (``nowindow``: off, every poll inside the steps),
cascade admission (``second_touch``; the default is vLLM's write-through), the fs
tier's page-cache bound (``pcN``: ``page_cache_bytes`` of N MiB per tier worker,
``pcauto``: "auto", ``pcoff``: null) and/or the promotion lane (``laneN``:
``tier_promotion_workers`` N; ``lane0``: every worker background, as before issue 29).

``--busy N`` runs every manager on a busy host: N processes spinning at niceness 0 from
before the first run to after the last (shmtier/bench/busy.py); the method lines say so.
``--long`` is issue 29's long run: the "long" chat trace (shmtier/bench/trace.py: 600
requests, 10.9 GiB of distinct KV) at ``LONG_RUN``'s sizes (1408 KiB chunks, 1 GiB CPU
tier, 5 ms steps), ~2 minutes a run; its verdict is issue 29's long-run goals
(shmtier/bench/goals.py ``LONG_RUN_GOALS``).

The parts live in the package (``shmtier bench`` ships them): shmtier/bench/baseline.py
(which vLLM, its connector's calls), shmtier/bench/managers.py
(building both managers), shmtier/bench/driver.py (one run: the driver and its timing),
shmtier/bench/report.py (summaries and tables), shmtier/bench/goals.py (issue 14's goals
and issue 29's per-step fixed costs, judged after a set with vLLM), shmtier/bench/trace.py
(the trace),
shmtier/bench/common.py (what every bench shares); this file is the command line.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import sys
import tempfile
import time

from shmtier.bench import baseline
from shmtier.bench import trace as bench_trace
from shmtier.bench.busy import BusyHost
from shmtier.bench.common import exit_through_finally, rotated, write_json
from shmtier.bench.goals import FIXED_COSTS, GOALS, LONG_RUN_GOALS, evaluate, format_goals
from shmtier.bench.driver import (Config, make_data_pool, run_once_more_on_stall,
                                  run_one)
from shmtier.bench.managers import VARIANT_TOKENS, WORKER_SCHED, known_manager
from shmtier.bench.report import (label, print_kinds, print_slowest, print_table, print_threads,
                                  summarise)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs per manager, interleaved")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 1 small run per manager (< 60 s with vLLM's import)")
    ap.add_argument("--managers", default="shmtier,vllm",
                    help="comma-separated: shmtier, vllm, and shmtier@TOKENS variants, TOKENS "
                         "'+'-joined worker scheduling (--worker-sched values) and/or compression "
                         "(raw = none, zstd, zauto = auto), dio / dioauto / buffered / dioadapt "
                         "(fs direct_io writes / auto / false / adaptive), pcN / pcauto / pcoff "
                         "(fs page_cache_bytes N MiB, auto, null), laneN "
                         "(tier_promotion_workers N), e.g. "
                         "shmtier,shmtier@nice0,shmtier@raw,shmtier@pc64,vllm; all interleaved")
    ap.add_argument("--long", action="store_true",
                    help="issue 29's long run: the 'long' chat trace (600 requests, 10.9 GiB of "
                         "distinct KV), 1408 KiB chunks, 1 GiB CPU tier: ~2 min a run")
    ap.add_argument("--chunk-kib", type=int, default=None,
                    help="chunk (arena row) KiB, page multiple (default 256; 1408 with --long)")
    ap.add_argument("--cpu-mib", type=int, default=None,
                    help="CPU tier MiB, both managers (default 128; 1024 with --long)")
    ap.add_argument("--workload", default="chat", choices=tuple(bench_trace.GENERATORS),
                    help="trace generator (shmtier/bench/trace.py): chat (multi-turn chat, "
                         "the flags below), docqa or agent (their default size; --requests "
                         "overrides)")
    ap.add_argument("--conversations", type=int, default=300, help="chat only")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests in the trace (default: 900 for chat, the generator's for others)")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--arrival-rate", type=float, default=1.0, help="requests per step")
    ap.add_argument("--step-ms", type=float, default=5.0,
                    help="engine step period: the simulated forward pass sleeps the rest")
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help="chunks a running request offers per step")
    ap.add_argument("--workers", type=int, default=2, help="shmtier num_tier_workers")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="a busy host: N processes spinning at niceness 0 from before the first "
                         "run to after the last, the same for every manager (default 0)")
    ap.add_argument("--worker-sched", default="default",
                    choices=tuple(WORKER_SCHED),
                    help="experiment: scheduling policy / niceness set on shmtier's tier workers "
                         "after they start (default: leave them as spawned)")
    ap.add_argument("--compression", default=None, choices=("auto", "zstd", "none"),
                    help="shmtier's compression mode (default: shmtier's default)")
    ap.add_argument("--fs-direct-io", default=None,
                    choices=("off", "writes", "auto", "on", "adaptive"),
                    help="shmtier's fs tier direct_io (default: the fs tier's default; off: "
                         "buffered; writes: O_DIRECT stores where the filesystem takes it, "
                         "buffered loads; auto: O_DIRECT both ways where taken; on: both "
                         "ways, required; adaptive: page cache first, O_DIRECT once it is "
                         "expensive)")
    ap.add_argument("--fs-write-depth", type=int, default=None,
                    help="shmtier's fs tier write_depth (default: its default)")
    ap.add_argument("--dir", default=None, help="parent of the fs tiers' temp dirs (default: system tmp)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", metavar="PATH", help="write every run's figures as JSON")
    ap.add_argument("--profile", default=None, metavar="MANAGER",
                    help="cProfile one run of this manager (driver thread) instead of the bench")
    args = ap.parse_args(argv)
    if args.long and (args.quick or args.workload != "chat"):
        ap.error("--long is a chat trace of its own size: not with --quick or --workload")
    preset = bench_trace.LONG_RUN if args.long else {"chunk_kib": 256, "cpu_mib": 128}
    args.chunk_kib = args.chunk_kib or preset["chunk_kib"]
    args.cpu_mib = args.cpu_mib or preset["cpu_mib"]
    if args.quick:
        args.repeats = 1
        args.conversations = min(args.conversations, 80)
        args.requests = min(args.requests or 200, 200)
        args.cpu_mib = min(args.cpu_mib, 32)
        args.step_ms = min(args.step_ms, 3.0)
    names = [n.strip() for n in args.managers.split(",") if n.strip()]
    for n in names + ([args.profile] if args.profile else []):
        if not known_manager(n):
            ap.error(f"unknown manager {n!r} (shmtier, vllm, or shmtier@TOKENS with "
                     f"TOKENS '+'-joined from {', '.join(VARIANT_TOKENS)}, pcN, pcauto, pcoff, "
                     "laneN)")
    if len(set(names)) != len(names):
        ap.error("--managers: a manager is listed twice")
    chunk_bytes = args.chunk_kib * 1024
    if chunk_bytes % 4096:
        ap.error("--chunk-kib must be a multiple of 4")
    if args.busy < 0:
        ap.error(f"--busy {args.busy}: expected a number of processes >= 0")
    exit_through_finally()  # unwinds through the finally blocks: managers, dirs, /dev/shm

    connector, vllm_note = baseline.load("vllm" in names or args.profile == "vllm")
    if connector.baseline is None and "vllm" in names:
        names.remove("vllm")
    cfg = Config(chunk_bytes=chunk_bytes, cpu_bytes=args.cpu_mib << 20, step_ms=args.step_ms,
                 max_running=args.max_running, batch=args.batch, workers=args.workers,
                 dir=args.dir or tempfile.gettempdir(), worker_sched=args.worker_sched,
                 compression=args.compression,
                 direct_io={"writes": "writes", "auto": "auto", "on": True, "off": False,
                            "adaptive": "adaptive", None: None}[args.fs_direct_io],
                 write_depth=args.fs_write_depth, connector=connector)

    t0 = time.perf_counter()
    if args.long:
        trace = bench_trace.generate("chat", "long", args.seed, requests=args.requests)
    elif args.workload == "chat":
        trace = bench_trace.make_trace(bench_trace.TraceParams(
            conversations=args.conversations, requests=args.requests or 900, zipf=args.zipf,
            arrival_rate=args.arrival_rate, seed=args.seed))
    else:
        trace = bench_trace.generate(args.workload, "default", args.seed, requests=args.requests)
    gen_s = time.perf_counter() - t0
    capacity = cfg.cpu_bytes // chunk_bytes
    data_pool = make_data_pool(chunk_bytes, 16, args.seed)

    with BusyHost(args.busy) as busy:  # spinners stopped after the last run, also on failure
        return _runs(args, names, cfg, connector, vllm_note, trace, gen_s, capacity, data_pool,
                     chunk_bytes, busy)


def _runs(args, names, cfg, connector, vllm_note, trace, gen_s, capacity, data_pool,
          chunk_bytes, busy) -> int:
    """The profile or the interleaved runs and their report (on a busy host with --busy)."""
    if args.profile:
        if args.profile == "vllm" and connector.baseline is None:
            print(f"cannot profile vllm: {vllm_note}")
            return 2
        prof = cProfile.Profile()
        res = run_one(args.profile, trace, cfg, data_pool, 0, prof)
        s = summarise(res, chunk_bytes)
        print(f"cProfile of one {label(args.profile)} run (driver thread only; "
              f"{trace.describe(capacity)}): step p50 {s['step_us_p50']:.0f} µs, "
              f"p99 {s['step_us_p99']:.0f} µs under the profiler")
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumulative").print_stats(45)
        return 0

    print("shmtier bench: tiering_steps - scheduler-side cost per engine step, shmtier vs "
          f"{connector.baseline or 'vLLM (not measured)'} tiering with an fs tier")
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs "
          f"(shared, noisy: read medians, mind the spreads), load avg {os.getloadavg()[0]:.2f} "
          f"at start; {vllm_note}")
    print("method:")
    print(f"  trace (shmtier/bench/trace.py, seed {args.seed}, generated in {gen_s:.2f} s, the same for "
          f"every run): {trace.describe(capacity)}")
    print(f"  sizes: chunk {args.chunk_kib} KiB (= arena row, no padding), CPU tier "
          f"{args.cpu_mib} MiB = {capacity} chunks for both managers, LRU, events off; fs tier "
          f"unbounded, fresh temp dir under {cfg.dir} per run (emptied after it, removed at exit:")
    print("    a removed run would tax the next one's file creations on ext4 without a journal, "
          "bench/README.md)")
    print(f"  shmtier: TieringOffloadingSpec(...).get_manager(), fs tier, num_tier_workers "
          f"{args.workers} (spawned processes; tier_promotion_workers its default, 1 of 2 or "
          f"more, unless shmtier@laneN; scheduling {args.worker_sched}: "
          f"{WORKER_SCHED[args.worker_sched]}), compression {args.compression or 'default'}, direct_io {args.fs_direct_io or 'default'}, write_depth {args.fs_write_depth or 'default'}, min_free_bytes None;"
          f" variants shmtier@TOKENS override scheduling / compression (raw = none) / direct_io (dio = writes)")
    print(f"  {label('vllm')}: TieringOffloadingManager(CPUPrimaryTierOffloadingManager(SharedOffloadRegion),"
          " [FileSystemTierManager]) built from its classes, fs tier defaults (16+16 I/O threads,"
          " O_DIRECT if the dir allows it, async lookup thread), no backpressure on either side")
    print(f"  driver = the connector's scheduler half (docs/vllm-contract.md §2.3), one step every "
          f"{args.step_ms:g} ms: admit waiting requests (up to {args.max_running} running): "
          "on_new_request once, lookup scan")
    print("    after the GPU-cached chunks until MISS (HIT_PENDING/RETRY defer to the next step, "
          "RETRY does not stop the scan),")
    print("    hits (capped so one chunk is computed) -> prepare_load + get_load_source per key; "
          f"running requests offer their next {args.batch} chunks")
    print("    to prepare_store (rows then filled with bf16-like random data + the key in the "
          "first 16 bytes, checked at every load);")
    print("    finished -> on_request_finished; on_schedule_end; sleep out the step (forward "
          "pass); complete_store/complete_load for")
    success = "passed" if connector.store_success_kwarg else "not passed"
    print("    jobs prepared the step before (their keys and complete_store's arguments as "
          f"vLLM {connector.line}'s connector passes them:")
    print(f"    {connector.as_dict()['job_keys']}, success= {success}); has_pending_work, "
          "get_stats, list(take_events()). After the trace: idle steps until")
    print("    has_pending_work() is False (drain, not in the step figures).")
    print("  timed: every manager call with perf_counter_ns, and thread_time_ns for its on-CPU part "
          "(a request's lookup scan as one region);")
    print("    per step the sum = scheduler-thread time. The managers' own get_stats payloads are "
          "folded (untimed) for their counters.")
    print("  CPU: time.process_time/thread_time and getrusage of this process over trace + "
          "drain; shmtier's tier workers from /proc/<pid>/stat")
    print("    (utime+stime). \"In the manager (spec)\" = the main thread's CPU inside the "
          "manager's calls (thread_time around them, drain")
    print("    included) + the process's other threads; the rest of the main thread is the "
          "driver's own work (trace, bookkeeping,")
    print("    row fill = the simulated GPU copy, load checks, clocks), the same for both "
          "managers, so it is not the spec's (issue 14's CPU goal).")
    print("  promotion latency: per (request, key), first lookup answering RETRY or HIT_PENDING "
          "(not for a store the driver has in flight) to its first HIT.")
    print("  hits: loaded chunks by get_load_source (host = CPU tier, disk = fs tier) over the "
          "chunks after the GPU-cached ones of admitted requests.")
    print("  disk: chunk files' st_size (and st_blocks) / (files x chunk bytes) after the drain.")
    print(f"  {busy.describe()}")
    print(f"  repeats: {args.repeats} per manager, interleaved (order rotated per run); before "
          "each run gc.collect() + gc.freeze() (as vLLM's engine core")
    print("    does after init), gc on; table: median [min-max] over runs, ratio of medians.")

    sums = {n: [] for n in names}
    raws = {n: [] for n in names}
    step_runs = {n: [] for n in names}  # per-step lists, for print_slowest

    def save(extra: dict) -> None:
        """The JSON (``--json``) of the runs so far: written after every run (``partial``:
        true, with each run's load average), so a bench stopped midway (minutes a run
        with ``--long``) keeps what it measured; then once more with the goals."""
        write_json(args.json, {"bench": "tiering_steps", "args": vars(args), "vllm": vllm_note,
                               "busy": busy.as_dict(), "baseline": connector.as_dict(),
                               "trace": trace.summary(), "summaries": sums, "runs": raws,
                               "stalls": stalls, "partial": True, **extra}, default=str)

    run_no = 0
    stalls: list[dict] = []  # runs that made no progress (each run again once)
    for r in range(args.repeats):
        for n in rotated(names, r):
            res, run_no = run_once_more_on_stall(n, trace, cfg, data_pool, run_no + 1, stalls)
            s = summarise(res, chunk_bytes)
            sums[n].append(s)
            raws[n].append({k: v for k, v in res.items()
                            if k not in ("step_ns", "step_cpu_ns", "step_kinds", "step_kinds_cpu",
                                         "step_lookups", "slow",
                                         "wake_late_ns")})
            step_runs[n].append({k: res[k] for k in ("step_ns", "step_cpu_ns", "step_kinds", "slow")})
            s["load_avg_after"] = os.getloadavg()[0]
            if args.json:
                save({})
            print(f"  run {r + 1}/{args.repeats} {label(n):>14}: {s['steps']} steps, step p50 "
                  f"{s['step_us_p50']:.0f} µs p99 {s['step_us_p99']:.0f} µs, promotion p50 "
                  f"{s['promo_ms_p50'] or 0:.0f} ms, deferral p99 {s['defer_p99']} steps, process CPU "
                  f"{s['cpu_s']:.2f} s (in the manager {s['spec_cpu_s']:.2f} s), wall {s['wall_s']:.1f} s, load avg {os.getloadavg()[0]:.2f}; "
                  f"hits CPU {s['hit_cpu']:.3f} fs {s['hit_fs']:.3f}, {s['cascaded_chunks']:.0f} "
                  f"chunks cascaded ({s['promotions_per_cascade'] or 0:.3f} promotions each, "
                  f"{s['cascaded_mib_per_fs_hit'] or 0:.1f} MiB per fs hit), "
                  f"{s['vllm:kv_offload_tiering_backpressure_blocks_dropped']:.0f} dropped"
                  + (f", workers {'; '.join(res['worker_sched'])}" if res.get("worker_sched") else "")
                  + (f", step-window rounds {res['window_poll'][0]} ({res['window_poll'][1]} skipped: "
                     "lock held)" if res.get("window_poll") else ""),
                  flush=True)

    print("\n=== results: median [min-max] over runs ===")
    print_table(sums, names)
    print_kinds(sums, names)
    print_threads(sums, names)
    print_slowest(step_runs, names)
    for n in names:
        rss = [x for s in sums[n] for x in (s["worker_rss_anon_mib"] or []) if x is not None]
        if rss:
            restarts = [s["worker_restarts"] for s in sums[n]]
            print(f"\n{label(n)} tier workers: private RSS (RssAnon) at end {min(rss):.0f}-"
                  f"{max(rss):.0f} MiB each; restarts {restarts}")
    print("lookup answers (first run): " + "; ".join(
        f"{label(n)} {sums[n][0]['lookup_results']}" for n in names))
    wrong = {n: sum(s["wrong_kv"] for s in sums[n]) for n in names}
    print("wrong KV served (loaded row differs from what its key stored, byte for byte): " + ", ".join(
        f"{label(n)} {wrong[n]} of {sum(s['verified'] for s in sums[n])}" for n in names))

    goals, fixed_costs = {}, {}
    if "vllm" in names:
        for n in names:
            if n == "vllm":
                continue
            goals[n] = evaluate(sums[n], sums["vllm"], LONG_RUN_GOALS if args.long else GOALS)
            print(f"\nissue {29 if args.long else 14}'s goals, {label(n)} vs {label('vllm')} "
                  "(ratio of the medians over runs; "
                  f"the spread: per run pair; bench/goals.py judges saved sets):")
            for line in format_goals(goals[n], label(n), label("vllm")):
                print("  " + line)
            fixed_costs[n] = evaluate(sums[n], sums["vllm"], FIXED_COSTS)
            print(f"issue 29's per-step fixed costs, {label(n)} vs {label('vllm')} (the same rules):")
            for line in format_goals(fixed_costs[n], label(n), label("vllm")):
                print("  " + line)
    for stall in stalls:
        print(f"run {stall['run_no']} of {label(stall['manager'])} made no progress and was run "
              f"again (not in the figures): {stall['error']}")
    print(f"load avg at end {os.getloadavg()[0]:.2f}")

    if args.json:
        save({"goals": goals, "fixed_costs": fixed_costs, "partial": False})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
