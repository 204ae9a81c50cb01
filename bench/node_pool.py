#!/usr/bin/env python
"""Data-parallel replicas on one node (issue 31): per-replica CPU tiers alone, with a shared fs
root on tmpfs, and with the node pool, at the same total memory.

Run from a checkout::

    nice -n 0 .venv/bin/python -m bench.node_pool              # N = 2 and 4, 3 repeats (~5 min)
    .venv/bin/python -m bench.node_pool --quick                # smoke test: N = 2, 1 small run each
    .venv/bin/python -m bench.node_pool --variants cpu,fs --replicas 2 --repeats 5
    .venv/bin/python -m bench.node_pool --json bench/results/node_pool.json

Method. One seeded multi-turn chat trace (shmtier/bench/trace.py) is split round-robin over
N replica processes (``Trace.round_robin``: request i goes to replica i mod N, as a router
sending each request to the next replica; arrival steps kept), so a conversation's next
turn usually lands on another replica than the one that stored its prefix. Each replica
is a spawned process with its own spec (``TieringOffloadingSpec``: its own segment, CPU
tier, tier workers) and engine id ``<id>_dp<rank>``, as vLLM names data-parallel
replicas; it builds its manager (shmtier/bench/managers.py ``make_shmtier``), waits until
every replica is built, then steps through its share with the bench's one driver
(shmtier/bench/driver.py ``measure``/``drive``, on the connector driver
shmtier/connector_driver.py): the OffloadingConnector's scheduler-half calls once per
step, every call timed, every loaded chunk checked byte for byte against what its key's
store wrote (the same data in every replica, a function of the key). Variants, at the same
total memory (C = ``--cpu-mib`` per replica, S = ``--shared-mib``):

* ``cpu`` (a): per-replica CPU tiers alone, each C + S/N;
* ``fs`` (b): per-replica CPU tiers of C + an ``fs`` tier on one shared root, a fresh
  directory on tmpfs (/dev/shm), compression as default (``auto``), probes of unknown
  keys on (the default: how a replica finds another's chunks), each engine's
  ``max_bytes`` S/N (each engine bounds what it stores: the files never exceed S in all);
* ``node`` (c): per-replica CPU tiers of C + the ``node`` tier (``{"type": "node",
  "size_bytes": S}``): one pool for the node, named by the engine id without ``_dp<rank>``.

Figures per set (all replicas of one run together; each figure's median [min-max] over
the repeats): hit rate = loaded chunks / chunks after the GPU prefix cache of admitted
requests, and its secondary part (loaded chunks a tier below the CPU tier promoted for
their request: answered RETRY/HIT_PENDING, then HIT); time to a promoted chunk (per
request and key: the lookup that first asked, answered RETRY or HIT_PENDING, to the lookup
answering HIT, i.e. the chunk promoted into the CPU tier and loaded in that step: p50/p99
ms and steps, pooled over the replicas; and the manager's own promotion-job histogram);
lookups per loaded chunk and RETRY answers per promoted chunk (each RETRY is a step the
request waits); the scheduler thread's step time (the manager calls of a step, under
``manager.lock``, wall: p50/p99 pooled over the replicas' steps, and the slowest replica's
p99; and its on-CPU part, ``thread_time`` around the same calls, which leaves out the time
the thread waited for a core; per call kind, on-CPU, per step and per call, and in each
replica's slowest 1% of steps on-CPU, what the step-p99 comparison is made of); memory per hit (the CPU tiers' bytes + S, over the hits); wrong bytes (any: exit 1).
Repeats alternate: each repeat runs every N and, per N, every variant, the variants'
order rotated per repeat.

Clean-up: every replica closes its manager (segment, workers) when done, also when told to
stop; the bench then removes whatever is left in /dev/shm under the run's engine ids
(segments, semaphores, the node pool) and the fs tier's tmpfs directory, also after a
failed run, Ctrl-C, SIGTERM or SIGHUP (a replica that does not stop in time is
terminated, then killed).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace

from shmtier.bench import baseline
from shmtier.bench import trace as bench_trace
from shmtier.bench.common import (exit_through_finally, fmt_mr, join_or_kill, med_range, pct,
                                  rotated, write_json)
from shmtier.bench.driver import Config, disk_usage
from shmtier.bench.managers import sweep_shm

MIB = 1 << 20
VARIANTS = {  # name: (letter, what it is)
    "cpu": ("a", "per-replica CPU tiers only"),
    "fs": ("b", "per-replica CPU tiers + fs tier on one shared tmpfs root"),
    "node": ("c", "per-replica CPU tiers + node pool"),
}
TMPFS = "/dev/shm"
READY_TIMEOUT_S = 180.0  # a replica's build: spawn, imports, segment, tier workers
STOP_TIMEOUT_S = 30.0  # a replica told to stop finishes its step and closes its manager


class ReplicaFailed(RuntimeError):
    """A replica process reported an error or died without a result."""


class Stopped(Exception):
    """Raised in a replica's driver between steps when the bench tells it to stop."""


# --------------------------------------------------------------------------- sizes and tiers


def variant_tiers(variant: str, n: int, cpu_bytes: int, shared_bytes: int,
                  root: str | None) -> tuple[int, list]:
    """A replica's CPU tier bytes and ``secondary_tiers`` in ``variant`` with ``n``
    replicas: the same total memory, N x CPU + the shared part (module docstring)."""
    if variant == "cpu":
        return cpu_bytes + shared_bytes // n, []
    if variant == "fs":
        return cpu_bytes, [{"type": "fs", "root_dir": root, "max_bytes": shared_bytes // n,
                            "min_free_bytes": None}]
    if variant == "node":
        return cpu_bytes, [{"type": "node", "size_bytes": shared_bytes}]
    raise ValueError(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")


def node_tier_available() -> bool:
    """Whether this checkout has the ``node`` tier type (issue 31)."""
    from shmtier.tiers import registry
    return registry.registered("node") is not None


# --------------------------------------------------------------------------- a replica


def replica_main(conn, rank: int, n: int, engine_id: str, cfg: Config, tiers: list,
                 trace_kw: dict, seed: int, stop) -> None:
    """One data-parallel replica (a spawned process): build the manager, report ready,
    wait for "go", drive its share of the trace, report the figures; close the manager
    (and sweep its /dev/shm entries) whatever happens. ``stop``: an Event the bench sets
    to end the run early (checked between steps)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's to handle
    exit_through_finally()
    mut = None
    try:
        from shmtier.bench.driver import make_data_pool, measure
        from shmtier.bench.managers import make_shmtier
        from shmtier.bench.report import summarise

        trace = bench_trace.make_trace(bench_trace.TraceParams(**trace_kw))
        share = trace.round_robin(n, rank)
        data_pool = make_data_pool(cfg.chunk_bytes, 16, seed)

        def progress(_fraction):
            if stop.is_set():
                raise Stopped()

        t0 = time.perf_counter()
        mut = make_shmtier(replace(cfg, progress=progress), "", engine_id, "",
                           secondary_tiers=tiers)
        build_s = time.perf_counter() - t0
        conn.send(("ready", os.getpid()))
        if conn.recv() != "go":
            return
        res = measure(mut, share, replace(cfg, progress=progress), data_pool)
        res["build_s"] = build_s
        t0 = time.perf_counter()
        mut.close()
        res["shutdown_s"] = time.perf_counter() - t0
        res["disk"] = {"chunk_files": 0, "other_files": 0, "dirs": 0, "bytes": 0,
                       "alloc_bytes": 0}  # the shared root is measured by the bench
        summary = summarise(res, cfg.chunk_bytes)
        keep = ("step_ns", "step_cpu_ns", "promo_ms", "promo_steps", "eligible", "loaded", "loaded_promoted",
                "lookup_results", "calls", "cpu_ns", "num_chunks", "row_stride", "wrong_kv",
                "wrong_bytes", "verified", "deferrals")
        raw = {k: res[k] for k in keep}
        raw["promo_job_s"] = res["mstats"]["promo_job_s"]
        conn.send(("done", {"rank": rank, "requests": len(share.requests), "summary": summary,
                            "raw": raw}))
    except Stopped:
        conn.send(("stopped", rank))
    except BaseException as e:  # noqa: BLE001 - reported to the bench, which fails the run
        traceback.clear_frames(e.__traceback__)  # frames hold views of the arena
        try:
            conn.send(("error", f"replica {rank}: {traceback.format_exc()}"))
        except OSError:
            pass
    finally:
        if mut is not None:
            try:
                mut.close()
            except Exception as e:  # noqa: BLE001 - report, keep cleaning
                print(f"  ! replica {rank}: shutdown failed: {type(e).__name__}: {e}",
                      file=sys.stderr)
        sweep_shm(engine_id)


# --------------------------------------------------------------------------- one set


def _collect(conns: list, procs: list, pending: set, timeout_s: float) -> dict:
    """The next message of each replica in ``pending`` (rank -> message); ReplicaFailed if
    one reports an error, dies without a message, or ``timeout_s`` passes."""
    got = {}
    deadline = time.monotonic() + timeout_s
    while pending - got.keys():
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReplicaFailed(f"replicas {sorted(pending - got.keys())} did not answer "
                                f"within {timeout_s:.0f} s")
        waiting = sorted(pending - got.keys())
        of = {conns[r]: r for r in waiting}
        of.update({procs[r].sentinel: r for r in waiting})
        for obj in mp.connection.wait(list(of), timeout=min(left, 1.0)):
            rank = of[obj]
            if rank in got:
                continue
            if conns[rank].poll():
                msg = conns[rank].recv()
                if msg[0] == "error":
                    raise ReplicaFailed(msg[1])
                got[rank] = msg
            elif not procs[rank].is_alive():
                raise ReplicaFailed(f"replica {rank} exited with code {procs[rank].exitcode} "
                                    "without a result")
    return got


def run_set(variant: str, n: int, run_no: int, args, cfg: Config, trace_kw: dict) -> dict:
    """One run of ``variant`` with ``n`` replica processes; every process, /dev/shm entry
    and tmpfs directory of the run gone when it returns or raises."""
    base = f"bench-np-{os.getpid()}-{run_no}"
    root = tempfile.mkdtemp(prefix=f"bench-np-fs-{os.getpid()}-{run_no}-", dir=args.fs_dir)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs, conns = [], []
    cpu_bytes, tiers = variant_tiers(variant, n, cfg.cpu_bytes, args.shared_mib * MIB, root)
    rcfg = replace(cfg, cpu_bytes=cpu_bytes)
    t0 = time.perf_counter()
    try:
        for rank in range(n):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=replica_main, name=f"replica{rank}",
                               args=(child_end, rank, n, f"{base}_dp{rank}", rcfg, tiers,
                                     trace_kw, args.seed, stop))
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        _collect(conns, procs, set(range(n)), READY_TIMEOUT_S)
        build_s = time.perf_counter() - t0
        for c in conns:
            c.send("go")
        limit = args.run_timeout_s
        done = _collect(conns, procs, set(range(n)), limit)
        replicas = [done[r][1] for r in range(n)]
        for p in procs:
            p.join(STOP_TIMEOUT_S)
        disk = disk_usage(root, ".kv") if variant == "fs" else None
        return {"variant": variant, "n": n, "run_no": run_no, "replicas": replicas,
                "cpu_bytes_each": cpu_bytes, "shared_bytes": args.shared_mib * MIB
                if variant != "cpu" else 0, "fs_disk": disk, "build_s": build_s,
                "wall_s": time.perf_counter() - t0}
    finally:
        stop.set()
        for c in conns:
            try:
                c.send("stop")  # one still waiting for "go"
            except OSError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: the replica exits through its finally blocks
        join_or_kill(procs, 10.0)
        for c in conns:
            c.close()
        left = sweep_shm(base)
        if left:
            print(f"  ! {variant} N={n}: removed leftover /dev/shm entries: {left}",
                  file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- figures


def figures(run: dict) -> dict:
    """One set's figures, all replicas together (module docstring)."""
    reps = run["replicas"]
    raw = [r["raw"] for r in reps]
    eligible = sum(r["eligible"] for r in raw) or 1
    loaded = sum(sum(r["loaded"].values()) for r in raw)
    promoted = sum(r["loaded_promoted"] for r in raw)
    lookups = sum(r["calls"]["lookup"] for r in raw)
    retry = sum(r["lookup_results"].get("RETRY", 0) for r in raw)
    pending = sum(r["lookup_results"].get("HIT_PENDING", 0) for r in raw)
    steps_us = [v / 1e3 for r in raw for v in r["step_ns"]]
    steps_cpu_us = [v / 1e3 for r in raw for v in r["step_cpu_ns"]]
    promo_ms = [v for r in raw for v in r["promo_ms"]]
    promo_steps = [v for r in raw for v in r["promo_steps"]]
    promo_job_ms = [v * 1e3 for r in raw for v in r["promo_job_s"]]
    deferrals = [v for r in raw for v in r["deferrals"]]
    cpu_total = sum(r["num_chunks"] * r["row_stride"] for r in raw)
    memory = cpu_total + run["shared_bytes"]
    disk = run.get("fs_disk") or {}
    return {
        "hit": loaded / eligible, "hit_secondary": promoted / eligible,
        "hit_cpu": (loaded - promoted) / eligible,
        "hit_disk": sum(r["loaded"].get("disk", 0) for r in raw) / eligible,
        "promoted_chunks": promoted, "promo_n": len(promo_ms),
        "promo_ms_p50": pct(promo_ms, 50), "promo_ms_p99": pct(promo_ms, 99),
        "promo_steps_p50": pct(promo_steps, 50), "promo_steps_p99": pct(promo_steps, 99),
        "promo_job_ms_p50": pct(promo_job_ms, 50), "promo_job_ms_p99": pct(promo_job_ms, 99),
        "lookups_per_loaded": lookups / loaded if loaded else None,
        "retry_per_promoted": retry / promoted if promoted else None,
        "retry": retry, "hit_pending": pending,
        "defer_mean": statistics.fmean(deferrals) if deferrals else None,
        "step_us_p50": pct(steps_us, 50), "step_us_p99": pct(steps_us, 99),
        "step_cpu_us_p50": pct(steps_cpu_us, 50), "step_cpu_us_p99": pct(steps_cpu_us, 99),
        "step_us_p99_worst": max(r["summary"]["step_us_p99"] for r in reps),
        "step_us_p99_each": [r["summary"]["step_us_p99"] for r in reps],
        "steps": len(steps_us),
        "memory_mib": memory / MIB, "cpu_mib": cpu_total / MIB,
        "memory_kib_per_hit": memory / 1024 / loaded if loaded else None,
        "fs_files_mib": disk.get("bytes", 0) / MIB if disk else None,
        "fs_alloc_mib": disk.get("alloc_bytes", 0) / MIB if disk else None,
        "hits": loaded, "eligible": eligible,
        "verified": sum(r["verified"] for r in raw),
        "wrong_chunks": sum(r["wrong_kv"] for r in raw),
        "wrong_bytes": sum(r["wrong_bytes"] for r in raw),
        "abandoned": sum(r["summary"]["abandoned"] for r in reps),
        "wall_s": run["wall_s"], "build_s": run["build_s"],
        **_per_kind_cpu(raw, len(steps_us)),
        **_slowest_steps_cpu([r["summary"] for r in reps]),
    }


#: the manager calls whose on-CPU time the tables break down (per step and per call)
CPU_KINDS = ("lookup", "prepare_store", "complete_store", "on_schedule_end", "get_stats")


def _per_kind_cpu(raw: list, steps: int) -> dict:
    """On-CPU µs of each of ``CPU_KINDS``: per step (mean over all replicas' steps) and
    per call, pooled over the replicas."""
    out = {}
    for kind in CPU_KINDS:
        ns = sum(r["cpu_ns"].get(kind, 0) for r in raw)
        calls = sum(r["calls"].get(kind, 0) for r in raw)
        out[f"cpu_step_{kind}"] = ns / 1e3 / steps if steps else None
        out[f"cpu_call_{kind}"] = ns / 1e3 / calls if calls else None
    return out


#: the calls the slowest steps' on-CPU breakdown shows (the larger ones of a step)
SLOW_KINDS = ("on_new_request", "lookup", "prepare_load", "prepare_store",
              "on_request_finished", "on_schedule_end", "complete_store", "get_stats")


def _slowest_steps_cpu(summaries: list) -> dict:
    """On-CPU µs of each of ``SLOW_KINDS`` and the lookup calls in the slowest 1% of
    steps (at or above the replica's on-CPU p99; ``shmtier/bench/report.py``), the mean
    over the replicas: what the step-p99 comparison is made of."""
    out = {f"slow_cpu_{kind}": statistics.fmean(s["slow_cpu_kind_us"][kind] for s in summaries)
           for kind in SLOW_KINDS}
    out["slow_cpu_lookups"] = statistics.fmean(s["slow_cpu_lookups"] for s in summaries)
    return out


ROWS = [  # (label, key, digits)
    ("hit rate, all tiers", "hit", 3),
    ("  from the CPU tier", "hit_cpu", 3),
    ("  secondary (promoted for the request)", "hit_secondary", 3),
    ("    get_load_source said DISK", "hit_disk", 3),
    ("time to a promoted chunk (first asking lookup -> HIT)", None, 0),
    ("  promoted keys", "promo_n", 0),
    ("  p50 ms", "promo_ms_p50", 2),
    ("  p99 ms", "promo_ms_p99", 2),
    ("  p50 steps", "promo_steps_p50", 0),
    ("  p99 steps", "promo_steps_p99", 0),
    ("  manager's promotion job p50 ms", "promo_job_ms_p50", 2),
    ("  manager's promotion job p99 ms", "promo_job_ms_p99", 2),
    ("lookups per loaded chunk", "lookups_per_loaded", 2),
    ("  RETRY answers per promoted chunk", "retry_per_promoted", 2),
    ("  deferred steps per request (mean)", "defer_mean", 2),
    ("scheduler-thread step time (all replicas' steps)", None, 0),
    ("  p50 µs", "step_us_p50", 1),
    ("  p99 µs", "step_us_p99", 1),
    ("  slowest replica's p99 µs", "step_us_p99_worst", 1),
    ("  on-CPU part (thread_time around the same calls) p50 µs", "step_cpu_us_p50", 1),
    ("  on-CPU part p99 µs", "step_cpu_us_p99", 1),
    ("on-CPU µs per step (mean) of the manager's calls", None, 0),
    *((f"  {kind}", f"cpu_step_{kind}", 1) for kind in CPU_KINDS),
    ("on-CPU µs per call", None, 0),
    *((f"  {kind}", f"cpu_call_{kind}", 2) for kind in CPU_KINDS),
    ("the slowest 1% of steps (on-CPU, per replica; mean over replicas)", None, 0),
    ("  lookup calls a step", "slow_cpu_lookups", 1),
    *((f"  {kind} µs", f"slow_cpu_{kind}", 1) for kind in SLOW_KINDS),
    ("memory", None, 0),
    ("  total MiB (CPU tiers + shared)", "memory_mib", 0),
    ("  KiB per hit", "memory_kib_per_hit", 1),
    ("  fs files at the end MiB (tmpfs allocated)", "fs_alloc_mib", 1),
    ("chunks loaded and checked byte for byte", "verified", 0),
    ("  wrong chunks", "wrong_chunks", 0),
    ("  wrong bytes", "wrong_bytes", 0),
    ("requests given up (self-eviction)", "abandoned", 0),
    ("wall s of the set (build, run, close)", "wall_s", 1),
]


def print_table(sets: dict, variants: list) -> None:
    w = 27
    print(f"{'':<56}" + "".join(f"{'(' + VARIANTS[v][0] + ') ' + v:>{w}}" for v in variants))
    for row_label, key, digits in ROWS:
        if key is None:
            print(row_label)
            continue
        cells = "".join(f"{fmt_mr(med_range([f[key] for f in sets[v]]), digits, collapse=True):>{w}}"
                        for v in variants)
        print(f"{row_label:<56}{cells}")


def verdict(sets: dict) -> list[str]:
    """The issue's three comparisons, on the medians over the repeats, with the ratio in
    each repeat (the variants of one repeat ran side by side) as [min-max]: (c) against (b)
    on promotion latency and hit rate, and (c)'s step p99 against (a)'s."""
    def med(v, key):
        mr = med_range([f[key] for f in sets.get(v, [])])
        return mr[0] if mr else None

    def paired(x, y, key):
        ratios = [fx[key] / fy[key] for fx, fy in zip(sets[x], sets[y]) if fx[key] is not None
                  and fy[key]]
        return f" (per repeat [{min(ratios):.2f}-{max(ratios):.2f}]x)" if ratios else ""

    lines = []
    if "node" in sets and "fs" in sets:
        for key, what in (("promo_ms_p50", "p50"), ("promo_ms_p99", "p99")):
            c, b = med("node", key), med("fs", key)
            if c is not None and b:
                lines.append(f"promotion latency {what}: (c) {c:.2f} ms vs (b) {b:.2f} ms = "
                             f"{c / b:.2f}x{paired('node', 'fs', key)}: (c) "
                             f"{'beats' if c < b else 'does not beat'} (b)")
        c, b = med("node", "hit"), med("fs", "hit")
        lines.append(f"hit rate: (c) {c:.3f} vs (b) {b:.3f} ({c - b:+.3f}): (c) "
                     f"{'matches or beats' if c >= b - 0.005 else 'is below'} (b) "
                     "(match: within 0.005)")
    if "node" in sets and "cpu" in sets:
        for key, what in (("step_us_p99", "step p99"), ("step_cpu_us_p99", "step on-CPU p99")):
            c, a = med("node", key), med("cpu", key)
            if c is not None and a:
                lines.append(f"{what}: (c) {c:.1f} µs vs (a) {a:.1f} µs = {c / a:.2f}x"
                             f"{paired('node', 'cpu', key)} "
                             f"({'within' if c <= 1.1 * a else 'not within'} 10%)")
    return lines


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="2,4", help="comma-separated replica counts N")
    ap.add_argument("--variants", default=None,
                    help="comma-separated from cpu (a), fs (b), node (c); default all this "
                         "checkout has")
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs per variant and N")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: N = 2, 1 repeat, a small trace and small tiers")
    ap.add_argument("--cpu-mib", type=int, default=32, help="C: each replica's CPU tier MiB")
    ap.add_argument("--shared-mib", type=int, default=512,
                    help="S: the shared memory MiB (node pool, fs max_bytes in all; (a) adds "
                         "S/N to each CPU tier)")
    ap.add_argument("--chunk-kib", type=int, default=256, help="chunk (arena row) KiB")
    ap.add_argument("--conversations", type=int, default=None, help="default 300 (40 quick)")
    ap.add_argument("--requests", type=int, default=None, help="default 1800 (120 quick)")
    ap.add_argument("--arrival-rate", type=float, default=2.0,
                    help="requests per step over all replicas")
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--max-running", type=int, default=16, help="per replica")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="num_tier_workers per replica")
    ap.add_argument("--fs-dir", default=TMPFS,
                    help="parent of the fs variant's shared root (default /dev/shm: tmpfs)")
    ap.add_argument("--run-timeout-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    trace_kw = {"conversations": 300, "requests": 1800}
    if args.quick:
        args.replicas, args.repeats = "2", 1
        args.cpu_mib, args.shared_mib = min(args.cpu_mib, 4), min(args.shared_mib, 16)
        args.step_ms = min(args.step_ms, 3.0)
        trace_kw.update(bench_trace.SIZES["quick"]["chat"])
    trace_kw.update({k: v for k, v in (("conversations", args.conversations),
                                       ("requests", args.requests)) if v is not None})
    trace_kw.update(arrival_rate=args.arrival_rate, seed=args.seed)
    try:
        ns = [int(x) for x in args.replicas.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--replicas {args.replicas!r}: expected comma-separated integers >= 1")
    if not ns or min(ns) < 1:
        ap.error(f"--replicas {args.replicas!r}: expected comma-separated integers >= 1")
    have_node = node_tier_available()
    variants = ([v.strip() for v in args.variants.split(",") if v.strip()] if args.variants
                else [v for v in VARIANTS if v != "node" or have_node])
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r} (expected cpu, fs, node)")
    if "node" in variants and not have_node:
        ap.error("--variants node: this checkout has no node tier type")
    chunk_bytes = args.chunk_kib * 1024
    if chunk_bytes % 4096:
        ap.error("--chunk-kib must be a multiple of 4")
    for n in ns:
        if (args.shared_mib * MIB) % (n * chunk_bytes):
            ap.error(f"--shared-mib {args.shared_mib}: S/N must be whole chunks for N = {n}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    exit_through_finally()  # SIGTERM/SIGHUP unwind through run_set's clean-up
    # Ctrl-C raises KeyboardInterrupt even when started with SIGINT ignored (a background
    # job of a non-interactive shell inherits SIG_IGN, and Python then installs no handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    trace = bench_trace.make_trace(bench_trace.TraceParams(**trace_kw))
    cfg = Config(chunk_bytes=chunk_bytes, cpu_bytes=args.cpu_mib * MIB, step_ms=args.step_ms,
                 max_running=args.max_running, batch=args.batch, workers=args.workers,
                 dir=args.fs_dir)
    conn = baseline.connector()
    print("shmtier bench: node_pool - data-parallel replicas on one node: CPU tiers alone (a), "
          "+ shared fs root on tmpfs (b), + node pool (c)")
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs "
          f"(shared, noisy: read medians, mind the spreads), niceness "
          f"{os.getpriority(os.PRIO_PROCESS, 0)}, load avg {os.getloadavg()[0]:.2f} at start")
    print("method:")
    for line in (__doc__.split("Method. ", 1)[1].split("\n\nClean-up:", 1)[0]).splitlines():
        print("  " + line)
    print(f"  trace: {trace.describe()}; shares: "
          + ", ".join(f"N={n}: {len(trace.requests) // n}-{-(-len(trace.requests) // n)} "
                      "requests each" for n in ns))
    c, s = args.cpu_mib, args.shared_mib
    for n in ns:
        print(f"  N={n}: (a) {n} x {c + s / n:g} MiB CPU; (b) {n} x {c} MiB CPU + fs max_bytes "
              f"{n} x {s / n:g} MiB; (c) {n} x {c} MiB CPU + node pool {s} MiB; = "
              f"{n * c + s} MiB each")
    print(f"  chunk {args.chunk_kib} KiB, step {args.step_ms:g} ms, up to {args.max_running} "
          f"running requests and {args.batch} chunks offered per step per replica, "
          f"num_tier_workers {args.workers} per replica (fs, node), LRU; connector {conn.replay}")
    print(f"  repeats: {args.repeats}, alternated (N in turn, variants rotated per repeat); "
          "table: median [min-max] over repeats", flush=True)

    sets = {n: {v: [] for v in variants} for n in ns}
    runs = []
    run_no = 0
    for r in range(args.repeats):
        for n in ns:
            for v in rotated(variants, r):
                run_no += 1
                run = run_set(v, n, run_no, args, cfg, trace_kw)
                f = figures(run)
                sets[n][v].append(f)
                runs.append({**{k: run[k] for k in ("variant", "n", "run_no", "cpu_bytes_each",
                                                    "shared_bytes", "fs_disk")},
                             "figures": f,
                             "replicas": [{k: x[k] for k in ("rank", "requests", "summary")}
                                          for x in run["replicas"]]})
                print(f"  run {r + 1}/{args.repeats} N={n} ({VARIANTS[v][0]}) {v:>4}: hit "
                      f"{f['hit']:.3f} (secondary {f['hit_secondary']:.3f}), promotion p50 "
                      f"{f['promo_ms_p50'] or 0:.1f} p99 {f['promo_ms_p99'] or 0:.1f} ms, "
                      f"lookups/loaded {f['lookups_per_loaded'] or 0:.2f}, step p50 "
                      f"{f['step_us_p50']:.0f} p99 {f['step_us_p99']:.0f} µs (per replica "
                      f"{', '.join(f'{x:.0f}' for x in f['step_us_p99_each'])}), "
                      f"{f['memory_kib_per_hit'] or 0:.0f} KiB/hit, wrong bytes "
                      f"{f['wrong_bytes']}, wall {f['wall_s']:.1f} s, load avg "
                      f"{os.getloadavg()[0]:.2f}", flush=True)

    wrong = 0
    for n in ns:
        print(f"\n=== N = {n} replicas: median [min-max] over {args.repeats} repeats ===")
        print_table(sets[n], variants)
        for line in verdict(sets[n]):
            print("  " + line)
        wrong += sum(f["wrong_bytes"] + f["wrong_chunks"] for v in variants for f in sets[n][v])
    print(f"\nwrong bytes served: {wrong} ({'FAIL' if wrong else 'none'}); load avg at end "
          f"{os.getloadavg()[0]:.2f}")
    if args.json:
        write_json(args.json, {"bench": "node_pool", "args": vars(args), "trace": trace.summary(),
                               "variants": variants, "runs": runs,
                               "verdicts": {str(n): verdict(sets[n]) for n in ns}},
                   default=str)
        print(f"wrote {args.json}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
