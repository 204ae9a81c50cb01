#!/usr/bin/env python
"""Per-call cost of the CPU primary tier, side by side with vLLM 0.33's CPUOffloadingManager.

Run from a checkout::

    .venv/bin/python -m bench.primary_calls                 # 10k chunks, 5 repeats, lru and arc
    .venv/bin/python -m bench.primary_calls --quick         # smoke test
    .venv/bin/python -m bench.primary_calls --json bench/results/primary_calls.json
    .venv/bin/python -m bench.primary_calls --profile seg --policy arc   # cProfile one run

What is timed: every manager call the OffloadingConnector's scheduler half makes
(docs/vllm-contract.md §2.3), each wrapped in ``time.perf_counter_ns``; a request's lookup scan
(one ``lookup`` per chunk until the first MISS) is timed as one region and
reported per ``lookup`` call. The driver's own work (building requests, keys,
``ReqContext`` positions, bookkeeping) is outside the timed regions. The same
driver, trace and policy drive each manager:

* ``seg``  - shmtier's ``CPUPrimaryTierOffloadingManager`` over a real POSIX
  shared-memory segment (what the scheduler runs);
* ``priv`` - shmtier's plain ``CPUOffloadingManager`` over a private chunk table
  (same code, process memory: separates the cost of the segment);
* ``vllm`` - vLLM 0.33's own ``CPUOffloadingManager`` (when vLLM is importable).

The three must make identical decisions (same hits, evictions, events); the bench
checks that and says so, because a diverging manager would be timed on a
different call sequence.

One module (~650 lines) on purpose: its workload, managers, driver and tables serve
this bench alone and read top to bottom; what the benches share is in common.py.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import shmtier.contract as shm_contract
from shmtier.bench.common import DrivenRequest, request_context
from shmtier.bench.common import exit_through_finally, fmt_mr, med_range, pct, rotated, write_json
from shmtier.scheduler.primary import (
    CPUOffloadingManager as ShmCPUOffloadingManager,
    CPUPrimaryTierOffloadingManager,
)
from shmtier.shared.chunk_table import ChunkTable
from shmtier.shared.layout import DEFAULT_KEY_WIDTH, ArenaGeometry
from shmtier.shared.segment import open_segment

# Call kinds, in the order a step makes them.
KINDS = (
    "complete_store",
    "complete_load",
    "on_new_request",
    "lookup",
    "prepare_load",
    "prepare_store",
    "on_request_finished",
    "get_stats",
    "take_events",
)
KEYED = ("lookup", "prepare_load", "prepare_store", "complete_store", "complete_load")

MANAGERS = ("seg", "priv", "vllm")
LABELS = {
    "seg": "shmtier segment",
    "priv": "shmtier private",
    "vllm": "vLLM 0.33",
}

SYS_PROMPTS = 8  # shared system prompts ...
SYS_PROMPT_CHUNKS = 4  # ... of this many chunks, at the head of every conversation
TOKENS_PER_CHUNK = 16  # ReqContext positions: chunk i ends at token (i+1)*16


# --------------------------------------------------------------------------- workload


@dataclass(slots=True)
class RequestSpec:
    conv: int
    keys: tuple  # the request's prefix, head first
    gpu_cached: int  # leading chunks the GPU prefix cache holds (lookup starts after them)
    decode_steps: int  # steps between the last store offer and finishing


@dataclass
class Workload:
    num_chunks: int
    requests: list
    num_conversations: int
    distinct_keys: int
    seed: int
    zipf: float

    def describe(self) -> str:
        lens = sorted(len(r.keys) for r in self.requests)
        return (
            f"{len(self.requests)} requests over {self.num_conversations} conversations "
            f"(Zipf {self.zipf}), prefix {lens[0]}-{lens[-1]} chunks (median "
            f"{lens[len(lens) // 2]}), {self.distinct_keys} distinct keys = "
            f"{self.distinct_keys / self.num_chunks:.1f}x capacity"
        )


def make_workload(num_chunks: int, num_requests: int, seed: int, zipf: float = 0.8,
                  working_set: float = 4.0) -> Workload:
    """A multi-turn chat trace.

    Conversations have a final length of 16-64 chunks (the first 4 are one of 8
    shared system prompts). Each request picks a conversation by Zipf popularity
    and is its next turn: 16 chunks for the first turn, then 8-16 more chunks per
    turn up to the conversation's length (afterwards the whole prefix again).
    Half the requests find the system prompt in the GPU prefix cache.
    """
    rng = random.Random(seed)

    def key() -> bytes:
        return rng.randbytes(32) + (0).to_bytes(4, "big")

    sys_prompts = [[key() for _ in range(SYS_PROMPT_CHUNKS)] for _ in range(SYS_PROMPTS)]
    num_convs = max(4, round(working_set * num_chunks / 40))
    convs = []
    for _ in range(num_convs):
        length = rng.randint(16, 64)
        convs.append(sys_prompts[rng.randrange(SYS_PROMPTS)]
                     + [key() for _ in range(length - SYS_PROMPT_CHUNKS)])
    order = list(range(num_convs))
    rng.shuffle(order)  # popularity rank independent of length
    cum, total = [], 0.0
    for rank in range(num_convs):
        total += 1.0 / (rank + 1) ** zipf
        cum.append(total)
    turn_len = [0] * num_convs
    requests = []
    for _ in range(num_requests):
        conv = order[rng.choices(range(num_convs), cum_weights=cum)[0]]
        full = len(convs[conv])
        cur = turn_len[conv]
        new = 16 if cur == 0 else min(full, cur + rng.randint(8, 16))
        turn_len[conv] = new
        requests.append(RequestSpec(
            conv=conv,
            keys=tuple(convs[conv][:new]),
            gpu_cached=SYS_PROMPT_CHUNKS if rng.random() < 0.5 else 0,
            decode_steps=rng.randint(0, 3),
        ))
    distinct = len({k for r in requests for k in r.keys})
    return Workload(num_chunks, requests, num_convs, distinct, seed, zipf)


# --------------------------------------------------------------------------- managers


@dataclass
class Flavor:
    """How to build, drive and tear down one manager implementation."""

    name: str
    make: object  # (num_chunks, policy, events) -> (manager, close)
    req_context: type
    lookup_result: type


def _make_seg(num_chunks, policy, events):
    geometry = ArenaGeometry(num_chunks=num_chunks, row_stride=4096, page_size_per_worker=4096,
                             world_size=1)
    engine_id = f"bench-primary-calls-{os.getpid()}-{time.monotonic_ns()}"
    segment = open_segment(engine_id, geometry, "bench", owner=True, prefault=False)
    try:
        manager = CPUPrimaryTierOffloadingManager(segment, cache_policy=policy,
                                                  enable_events=events)
    except BaseException:
        segment.close()
        raise
    return manager, manager.shutdown  # shutdown closes and unlinks the segment


def _make_priv(num_chunks, policy, events):
    table = ChunkTable.private(num_chunks, DEFAULT_KEY_WIDTH)
    manager = ShmCPUOffloadingManager(table, policy, enable_events=events)
    return manager, manager.shutdown


def load_flavors(want_vllm: bool) -> tuple[list[Flavor], str]:
    flavors = [
        Flavor("seg", _make_seg, shm_contract.ReqContext, shm_contract.LookupResult),
        Flavor("priv", _make_priv, shm_contract.ReqContext, shm_contract.LookupResult),
    ]
    if not want_vllm:
        return flavors, "vLLM: skipped (--no-vllm)"
    t0 = time.perf_counter()
    try:
        import vllm  # noqa: F401
        from vllm.v1.kv_offload.base import LookupResult as VllmLookupResult
        from vllm.v1.kv_offload.base import ReqContext as VllmReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager
    except Exception as e:  # noqa: BLE001 - any import failure means "run shmtier alone"
        return flavors, f"vLLM: NOT importable ({type(e).__name__}: {e}); shmtier measured alone"

    def _make_vllm(num_chunks, policy, events):
        manager = VllmManager(num_chunks=num_chunks, cache_policy=policy, enable_events=events)
        return manager, (lambda: None)

    flavors.append(Flavor("vllm", _make_vllm, VllmReqContext, VllmLookupResult))
    version = getattr(vllm, "__version__", "?")
    return flavors, f"vLLM {version} imported in {time.perf_counter() - t0:.1f} s (not timed)"


# --------------------------------------------------------------------------- driver


@dataclass
class RunResult:
    ns: dict  # kind -> total ns
    calls: dict  # kind -> calls
    keys: dict  # kind -> keys passed
    step_ns: list
    wall_s: float
    decisions: dict = field(default_factory=dict)


def drive(manager, flavor: Flavor, workload: Workload, max_running: int, batch: int) -> RunResult:
    """Drive ``manager`` like the connector's scheduler half for the whole trace."""
    pc = time.perf_counter_ns
    MISS = flavor.lookup_result.MISS
    HIT = flavor.lookup_result.HIT
    ReqContext = flavor.req_context
    ns = dict.fromkeys(KINDS, 0)
    calls = dict.fromkeys(KINDS, 0)
    nkeys = dict.fromkeys(KINDS, 0)
    step_ns: list[int] = []
    evict_hash = hashlib.blake2b(digest_size=8)
    dec = dict(lookups=0, hits=0, pending=0, deferrals=0, loads=0, stored=0, offered=0,
               evicted=0, alloc_failures=0, event_keys_stored=0, event_keys_removed=0)

    lookup = manager.lookup
    waiting = deque(DrivenRequest(spec) for spec in workload.requests)
    running: list[DrivenRequest] = []
    done_jobs: list = []  # (is_store, req, keys) prepared last step, reported complete now
    t_start = time.perf_counter()
    while waiting or running or done_jobs:
        step = 0
        # update_connector_output: last step's jobs completed
        for is_store, req, keys in done_jobs:
            if is_store:
                t0 = pc()
                manager.complete_store(keys, req.ctx)
                dt = pc() - t0
                kind = "complete_store"
            else:
                t0 = pc()
                manager.complete_load(keys, req.ctx)
                dt = pc() - t0
                kind = "complete_load"
                req.waiting_load = False
            ns[kind] += dt
            calls[kind] += 1
            nkeys[kind] += len(keys)
            step += dt
        new_jobs = []

        # schedule(): admit waiting requests (lookup scan; deferred ones stay waiting)
        skipped = []
        free = max_running - len(running)
        while free > 0 and waiting:
            req = waiting.popleft()
            spec = req.spec
            keys = spec.keys
            if req.ctx is None:
                ctx = req.ctx = request_context(ReqContext, f"req-{id(req)}", keys, TOKENS_PER_CHUNK)
                t0 = pc()
                manager.on_new_request(ctx)
                dt = pc() - t0
                ns["on_new_request"] += dt
                calls["on_new_request"] += 1
                step += dt
            ctx = req.ctx
            g, n = spec.gpu_cached, len(keys)
            hits = 0
            deferred = False
            t0 = pc()
            for i in range(g, n):
                res = lookup(keys[i], ctx)
                if res is MISS:
                    break
                if res is not HIT:
                    deferred = True
                hits += 1
            dt = pc() - t0
            scanned = hits + (1 if g + hits < n else 0)
            ns["lookup"] += dt
            calls["lookup"] += scanned
            nkeys["lookup"] += scanned
            step += dt
            dec["lookups"] += scanned
            if deferred:
                dec["deferrals"] += 1
                skipped.append(req)
                continue
            load_keys = req.admit(hits)  # at least one chunk is computed
            dec["hits"] += len(load_keys)
            if load_keys:
                t0 = pc()
                manager.prepare_load(load_keys, ctx)
                dt = pc() - t0
                ns["prepare_load"] += dt
                calls["prepare_load"] += 1
                nkeys["prepare_load"] += len(load_keys)
                step += dt
                new_jobs.append((False, req, load_keys))
                dec["loads"] += len(load_keys)
            running.append(req)
            free -= 1
        if skipped:
            waiting.extendleft(reversed(skipped))

        # build_connector_meta: store offers, then finished requests
        still_running = []
        for req in running:
            action = req.next_action()
            if action == "offer":
                keys = req.spec.keys
                offer = list(keys[req.cursor:req.cursor + batch])
                t0 = pc()
                out = manager.prepare_store(offer, req.ctx)
                dt = pc() - t0
                ns["prepare_store"] += dt
                calls["prepare_store"] += 1
                nkeys["prepare_store"] += len(offer)
                step += dt
                dec["offered"] += len(offer)
                if out is None:
                    dec["alloc_failures"] += 1  # retried next step
                else:
                    to_store = list(out.keys_to_store)
                    if to_store:
                        new_jobs.append((True, req, to_store))
                        dec["stored"] += len(to_store)
                    if out.evicted_keys:
                        dec["evicted"] += len(out.evicted_keys)
                        for key in out.evicted_keys:
                            evict_hash.update(key)
                    req.cursor += len(offer)
                still_running.append(req)
            elif action == "finish":
                t0 = pc()
                manager.on_request_finished(req.ctx)
                dt = pc() - t0
                ns["on_request_finished"] += dt
                calls["on_request_finished"] += 1
                step += dt
            else:  # waits for its load, or decodes
                still_running.append(req)
        running = still_running

        # per-step hooks outside schedule()
        t0 = pc()
        manager.get_stats()
        dt = pc() - t0
        ns["get_stats"] += dt
        calls["get_stats"] += 1
        step += dt
        t0 = pc()
        events = list(manager.take_events())
        dt = pc() - t0
        ns["take_events"] += dt
        calls["take_events"] += 1
        step += dt
        for event in events:
            dec["event_keys_removed" if event.removed else "event_keys_stored"] += len(event.keys)

        step_ns.append(step)
        done_jobs = new_jobs
    dec["steps"] = len(step_ns)
    dec["evicted_digest"] = evict_hash.hexdigest()
    return RunResult(ns, calls, nkeys, step_ns, time.perf_counter() - t_start, dec)


def run_one(flavor: Flavor, workload: Workload, policy: str, events: bool, max_running: int,
            batch: int, profiler: cProfile.Profile | None = None) -> RunResult:
    manager, close = flavor.make(workload.num_chunks, policy, events)
    try:
        gc.collect()
        if profiler is not None:
            profiler.enable()
        try:
            return drive(manager, flavor, workload, max_running, batch)
        finally:
            if profiler is not None:
                profiler.disable()
    finally:
        close()


# --------------------------------------------------------------------------- report


def summarise(run: RunResult) -> dict:
    per_call = {k: (run.ns[k] / run.calls[k] / 1e3 if run.calls[k] else None) for k in KINDS}
    per_key = {k: (run.ns[k] / run.keys[k] / 1e3 if run.keys[k] else None) for k in KEYED}
    steps = run.step_ns
    return {
        "us_per_call": per_call,
        "us_per_key": per_key,
        "calls": dict(run.calls),
        "keys": dict(run.keys),
        "total_ns": dict(run.ns),
        "step_us_mean": sum(steps) / len(steps) / 1e3,
        "step_us_p50": pct(steps, 50) / 1e3,
        "step_us_p99": pct(steps, 99) / 1e3,
        "step_us_max": max(steps) / 1e3,
        "manager_ms_total": sum(steps) / 1e6,
        "wall_s": run.wall_s,
        "decisions": run.decisions,
    }


def timer_overhead_ns(samples: int = 200_000) -> float:
    pc = time.perf_counter_ns
    best = []
    for _ in range(5):
        t0 = pc()
        for _ in range(samples):
            pc()
            pc()
        best.append((pc() - t0) / samples)
    # one timed region = two perf_counter_ns calls; the loop's own cost is included (upper bound)
    return statistics.median(best)


def print_policy_table(policy: str, results: dict, names: list, ratio_target: float) -> list:
    """Print the per-call table of one policy; returns the calls over the target."""
    have_vllm = "vllm" in names
    cols = [n for n in MANAGERS if n in names]

    def cells(values_of, digits) -> tuple[str, tuple | None]:
        """Each manager's median [min-max] of ``values_of(runs)``; with vLLM measured,
        also the (seg/vLLM, priv/vLLM) ratios of the medians."""
        text, meds = "", {}
        for n in cols:
            mr = med_range(values_of(results[n]))
            meds[n] = mr[0] if mr else None
            text += f"  {fmt_mr(mr, digits):>22}"
        ratios = None
        if have_vllm and meds.get("vllm"):
            ratios = meds["seg"] / meds["vllm"], meds["priv"] / meds["vllm"]
        return text, ratios

    print(f"\n=== policy {policy}: µs per call, median over repeats [min-max] ===")
    head = f"{'call':<20}{'calls/run':>10}{'keys/call':>10}"
    for n in cols:
        head += f"  {LABELS[n]:>22}"
    if have_vllm:
        head += f"  {'seg/vLLM':>9}  {'priv/vLLM':>9}"
    print(head)
    over = []
    for kind in KINDS:
        ref = results[cols[0]][0]
        calls = ref["calls"][kind]
        if not calls:
            continue
        kpc = ref["keys"][kind] / calls if kind in KEYED else None
        text, ratios = cells(lambda runs: [r["us_per_call"][kind] for r in runs], 2)
        line = f"{kind:<20}{calls:>10}{(f'{kpc:.1f}' if kpc is not None else '-'):>10}" + text
        if ratios:
            rs, rp = ratios
            flag = " !" if rs > ratio_target else ""
            line += f"  {rs:>8.2f}x  {rp:>8.2f}x{flag}"
            if rs > ratio_target:
                over.append((kind, rs))
        print(line)

    print(f"\n--- policy {policy}: µs per key (calls that take key lists), median [min-max] ---")
    for kind in KEYED:
        if not results[cols[0]][0]["keys"][kind]:
            continue
        text, ratios = cells(lambda runs: [r["us_per_key"][kind] for r in runs], 3)
        line = f"{kind:<20}{'':>20}" + text
        if ratios:
            line += f"  {ratios[0]:>8.2f}x  {ratios[1]:>8.2f}x"
        print(line)

    print(f"\n--- policy {policy}: manager time per simulated step (sum of all timed calls) ---")
    for label, field_ in (("step mean µs", "step_us_mean"), ("step p50 µs", "step_us_p50"),
                          ("step p99 µs", "step_us_p99"), ("step max µs", "step_us_max"),
                          ("run total ms", "manager_ms_total"), ("run wall s", "wall_s")):
        text, ratios = cells(lambda runs: [r[field_] for r in runs],
                             1 if "wall" not in field_ else 2)
        line = f"{label:<20}{'':>20}" + text
        if ratios and field_ != "wall_s":
            line += f"  {ratios[0]:>8.2f}x  {ratios[1]:>8.2f}x"
        print(line)
    return over


def check_decisions(results: dict, names: list) -> tuple[bool, str]:
    first = results[names[0]][0]["decisions"]
    same = all(r["decisions"] == first for n in names for r in results[n])
    d = first
    text = (f"steps {d['steps']}, lookups {d['lookups']}, loaded {d['loads']}, "
            f"deferrals (HIT_PENDING) {d['deferrals']}, offered {d['offered']}, "
            f"stored {d['stored']}, evicted {d['evicted']}, alloc failures "
            f"{d['alloc_failures']}, event keys stored/removed "
            f"{d['event_keys_stored']}/{d['event_keys_removed']}")
    return same, text


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=10_000, help="CPU tier capacity (chunks)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests in the trace (default: 0.6 x chunks)")
    p.add_argument("--repeats", type=int, default=5, help="runs per manager (fresh each time)")
    p.add_argument("--policy", choices=("lru", "arc", "both"), default="both")
    p.add_argument("--quick", action="store_true",
                   help="small run for smoke testing (1000 chunks, 2 repeats)")
    p.add_argument("--json", metavar="PATH", help="write all figures (every repeat) as JSON")
    p.add_argument("--no-vllm", action="store_true", help="do not import or measure vLLM")
    p.add_argument("--no-events", action="store_true", help="enable_events=False")
    p.add_argument("--max-running", type=int, default=16, help="concurrent requests per step")
    p.add_argument("--batch", type=int, default=16, help="keys per prepare_store offer")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--target", type=float, default=1.5,
                   help="flag calls where shmtier segment / vLLM exceeds this ratio")
    p.add_argument("--profile", choices=MANAGERS, default=None,
                   help="instead of the benchmark: cProfile one run of this manager and print "
                        "the top functions (first policy of --policy)")
    args = p.parse_args(argv)
    if args.quick:
        args.chunks = min(args.chunks, 1000)
        args.repeats = min(args.repeats, 2)
    num_requests = args.requests if args.requests is not None else max(40, int(0.6 * args.chunks))
    policies = ["lru", "arc"] if args.policy == "both" else [args.policy]
    events = not args.no_events

    exit_through_finally()  # (closes segments)

    flavors, vllm_note = load_flavors(not args.no_vllm)
    by_name = {f.name: f for f in flavors}
    names = [f.name for f in flavors]

    t0 = time.perf_counter()
    workload = make_workload(args.chunks, num_requests, args.seed)
    gen_s = time.perf_counter() - t0

    if args.profile:
        flavor = by_name.get(args.profile)
        if flavor is None:
            print(f"cannot profile {args.profile!r}: {vllm_note}")
            return 2
        prof = cProfile.Profile()
        run = run_one(flavor, workload, policies[0], events, args.max_running, args.batch, prof)
        print(f"cProfile of one run: {LABELS[args.profile]}, policy {policies[0]}, "
              f"{workload.describe()}; wall {run.wall_s:.2f} s under the profiler")
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(30)
        return 0

    over_ns = timer_overhead_ns()
    print("shmtier bench: primary_calls - per-call cost of the CPU primary tier manager")
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs "
          f"(shared, noisy machine: read medians, mind the spreads); {vllm_note}")
    print("method:")
    print(f"  trace: {workload.describe()}; generated in {gen_s:.1f} s, identical for every "
          f"manager and repeat (seed {args.seed}).")
    print(f"  capacity {args.chunks} chunks; up to {args.max_running} running requests; "
          f"events {'on' if events else 'off'}; keys = 32 random bytes + 4-byte group index.")
    print("  each step (like the connector, docs/vllm-contract.md §2.3): complete_store/complete_load for jobs "
          "prepared the step before;")
    print("  admit waiting requests: on_new_request once, lookup scan over the prefix (after "
          "GPU-cached chunks) until MISS,")
    print("  HIT_PENDING defers to the next step, hits (capped so one chunk is computed) -> "
          "prepare_load;")
    print(f"  every running request offers its next {args.batch} chunks to prepare_store "
          f"(positions (i+1)*{TOKENS_PER_CHUNK} set); finished -> on_request_finished;")
    print("  then get_stats() and list(take_events()).")
    print("  timed: each call with perf_counter_ns (a lookup scan as one region, divided per "
          f"lookup); timer overhead ~{over_ns:.0f} ns per timed region, included.")
    print(f"  repeats: {args.repeats} per manager and policy, fresh manager each time, managers "
          "interleaved (order rotated per repeat), gc.collect() before each run, gc on.")
    print(f"  figures: per run mean µs/call (total ns / calls); table shows the median over "
          f"repeats [min-max]. Target: shmtier segment within {args.target}x of vLLM per call.")
    print(f"  managers: {', '.join(f'{n} = {LABELS[n]}' for n in names)}")

    all_results: dict = {}
    overs = {}
    ok_decisions = True
    for policy in policies:
        results = {n: [] for n in names}
        for r in range(args.repeats):
            for n in rotated(names, r):
                run = run_one(by_name[n], workload, policy, events, args.max_running, args.batch)
                results[n].append(summarise(run))
        same, text = check_decisions(results, names)
        ok_decisions &= same
        print(f"\npolicy {policy}: {text}")
        print(f"  decisions identical across managers and repeats: "
              f"{'yes' if same else 'NO - managers diverge, timings compare different work'}")
        if not same:
            for n in names:
                print(f"    {n}: {results[n][0]['decisions']}")
        overs[policy] = print_policy_table(policy, results, names, args.target)
        all_results[policy] = results

    if "vllm" in names:
        print()
        for policy in policies:
            if overs[policy]:
                calls = ", ".join(f"{k} {r:.2f}x" for k, r in overs[policy])
                print(f"policy {policy}: over the {args.target}x target: {calls}")
            else:
                print(f"policy {policy}: every call within {args.target}x of vLLM")

    if args.json:
        write_json(args.json, {
            "bench": "primary_calls",
            "config": {
                "chunks": args.chunks, "requests": num_requests, "repeats": args.repeats,
                "policies": policies, "events": events, "max_running": args.max_running,
                "batch": args.batch, "seed": args.seed, "quick": args.quick,
                "workload": workload.describe(), "vllm": vllm_note,
                "timer_overhead_ns": over_ns, "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "decisions_identical": ok_decisions,
            "over_target": {p: overs[p] for p in policies},
            "results": all_results,
        })
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
