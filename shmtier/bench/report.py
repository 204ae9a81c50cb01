"""The report of tiering_steps.py: one run's raw figures summarised (``summarise``),
and the tables over runs: median [min-max] per manager with the ratio to vLLM's
(``print_table``), where the scheduler-thread time goes per call kind, over all
steps and in the slowest 1% (``print_kinds``), and what the slowest steps are made of
(``print_slowest``, from shmtier/bench/slow_steps.py).
"""

from __future__ import annotations

import statistics

from shmtier.bench import baseline
from shmtier.bench.common import fmt_mr, med_range, pct
from shmtier.bench.driver import KINDS, MANAGER_COUNTERS, READ_BYTES, WRITE_BYTES
from shmtier.bench.slow_steps import attribute, format_table
from shmtier.storage.tier_metrics import DIRECT_STORES, PAGE_CACHE_BOUNDED, RING_DEPTH

def label(name: str) -> str:
    """Column label of a manager name: ``vllm`` (the loaded vLLM's version, e.g. "vLLM
    0.34.0": shmtier/bench/baseline.py), ``shmtier`` or ``shmtier@TOKENS``."""
    return baseline.label() if name == "vllm" else name


def summarise(res: dict, chunk_bytes: int) -> dict:
    steps_us = [v / 1e3 for v in res["step_ns"]]
    cpu_us = [v / 1e3 for v in res["step_cpu_ns"]]
    n_steps = len(steps_us)
    total_lookups = res["calls"]["lookup"]
    loaded_total = sum(res["loaded"].values())
    host = res["loaded"].get("host", 0)
    disk = res["loaded"].get("disk", 0)
    elig = res["eligible"] or 1
    d = res["disk"]
    logical = d["chunk_files"] * chunk_bytes
    defer = res["deferrals"]
    s = {
        "step_us_p50": pct(steps_us, 50), "step_us_p90": pct(steps_us, 90),
        "step_us_p99": pct(steps_us, 99), "step_us_p999": pct(steps_us, 99.9),
        "step_us_max": max(steps_us),
        "step_us_mean": sum(steps_us) / n_steps,
        "manager_ms_total": sum(steps_us) / 1e3,
        "step_cpu_us_p50": pct(cpu_us, 50), "step_cpu_us_p99": pct(cpu_us, 99),
        "step_cpu_us_max": max(cpu_us), "step_cpu_us_mean": sum(cpu_us) / n_steps,
        "offcpu_us_p99": pct([w - c for w, c in zip(steps_us, cpu_us)], 99),
        **wake_lateness(res.get("wake_late_ns")),
        "steps": n_steps, "drain_steps": res["drain_steps"],
        "cpu_s": res["cpu_s"], "main_thread_cpu_s": res["main_thread_cpu_s"],
        "other_threads_cpu_s": res["cpu_s"] - res["main_thread_cpu_s"],
        "fill_cpu_s": res["fill_cpu_s"],
        "cpu_excl_fill_s": res["cpu_s"] - res["fill_cpu_s"],
        **spec_cpu(res),
        "sys_cpu_s": res["ru_sys_s"], "user_cpu_s": res["ru_user_s"],
        "vol_ctx_switches": res["ru_nvcsw"], "invol_ctx_switches": res["ru_nivcsw"],
        "workers_cpu_s": res["workers_cpu_s"],
        "promo_n": len(res["promo_steps"]),
        "promo_steps_p50": pct(res["promo_steps"], 50), "promo_steps_p99": pct(res["promo_steps"], 99),
        "promo_ms_p50": pct(res["promo_ms"], 50), "promo_ms_p99": pct(res["promo_ms"], 99),
        "promo_ms_max": max(res["promo_ms"]) if res["promo_ms"] else None,
        "probe_miss_n": len(res["probe_miss_steps"]),
        "defer_mean": sum(defer) / len(defer) if defer else None,
        "defer_p50": pct(defer, 50), "defer_p99": pct(defer, 99),
        "defer_max": max(defer) if defer else None,
        "deferred_frac": sum(1 for x in defer if x) / len(defer) if defer else None,
        "queue_p50": pct(res["queue_steps"], 50), "queue_p99": pct(res["queue_steps"], 99),
        # requests the driver gave up (driver.SELF_EVICTION); absent from an older result
        "abandoned": len(res.get("abandoned", ())),
        "abandoned_requests": list(res.get("abandoned", ())),
        "self_eviction_scans_max": res.get("self_eviction_scans_max"),
        "lookups": total_lookups, "lookups_per_step": total_lookups / n_steps,
        "lookups_per_loaded_chunk": total_lookups / loaded_total if loaded_total else None,
        "pending_frac": (res["lookup_results"].get("HIT_PENDING", 0)
                         + res["lookup_results"].get("RETRY", 0)) / max(1, total_lookups),
        "hit_cpu": host / elig, "hit_fs": disk / elig, "miss": (elig - loaded_total) / elig,
        "hit_other": (loaded_total - host - disk) / elig,
        "alloc_failures": res["alloc_failures"],
        "disk_per_logical": d["bytes"] / logical if logical else None,
        "disk_alloc_per_logical": d["alloc_bytes"] / logical if logical else None,
        "disk_mib": d["bytes"] / 2 ** 20, "chunk_files": d["chunk_files"], "dirs": d["dirs"],
        "stored_chunks": res["stored_chunks"],
        "wrong_kv": res["wrong_kv"], "verified": res["verified"],
        "wrong_bytes": res.get("wrong_bytes", 0),  # absent from an older result
        # loaded chunks a tier below the CPU tier promoted for their request, whatever
        # get_load_source called them (a CPU-medium tier's are "host")
        "hit_promoted": res.get("loaded_promoted", 0) / elig,
        "gc_collections": res["gc"]["collections"], "gc_total_ms": res["gc"]["total_ms"],
        "gc_max_ms": res["gc"]["max_ms"],
        "wall_s": res["wall_s"], "build_s": res["build_s"], "shutdown_s": res["shutdown_s"],
    }
    s["per_kind_us_per_step"] = {k: res["ns"][k] / 1e3 / n_steps for k in KINDS}
    ms = res["mstats"]
    for _, name in MANAGER_COUNTERS:
        s[name] = ms["counters"].get(name, 0)
    s["ring_depth_max"] = ms["gauge_max"].get(RING_DEPTH)
    s["page_cache_bounded"] = ms["gauge_max"].get(PAGE_CACHE_BOUNDED)
    s["direct_stores"] = ms["gauge_max"].get(DIRECT_STORES)
    s.update(cascade_yield(ms["counters"], disk, s["hit_fs"], res.get("row_stride") or chunk_bytes))
    s.update(cpu_per_kind(s, res.get("workers_cpu_by_lane")))
    s["threads_cpu"] = res.get("threads_cpu")  # the scheduler process's threads by kind
    # fs unbounded: one file per distinct chunk ever cascaded
    s["cascaded_read_back"] = (res["read_back_keys"] / d["chunk_files"]
                               if d["chunk_files"] and "read_back_keys" in res else None)
    s["promo_job_ms_p50"] = pct([v * 1e3 for v in ms["promo_job_s"]], 50)
    s["promo_job_ms_p99"] = pct([v * 1e3 for v in ms["promo_job_s"]], 99)
    s["per_kind_cpu_us_per_step"] = {k: res["cpu_ns"][k] / 1e3 / n_steps for k in KINDS}
    s["per_kind_us_per_call"] = {k: (res["ns"][k] / 1e3 / res["calls"][k] if res["calls"][k] else None)
                                 for k in KINDS}
    s["calls_per_run"] = dict(res["calls"])
    # the slowest 1% of steps, wall and on-CPU (what the thread itself did, not its
    # waits): what they spend their time on
    slow, s["slow_kind_us"], s["slow_lookups"], _ = _slowest(steps_us, res["step_kinds"], res)
    s["slow_steps"] = len(slow)
    _, s["slow_cpu_kind_us"], s["slow_cpu_lookups"], s["slow_cpu_us"] = _slowest(
        cpu_us, res["step_kinds_cpu"], res)
    s["all_lookups_per_step"] = sum(res["step_lookups"]) / n_steps
    s["lookup_results"] = res["lookup_results"]
    s["worker_rss_anon_mib"] = res["worker_rss_anon_mib"]
    s["worker_restarts"] = res["worker_restarts"]
    s["slowest"] = attribute([res])  # this run's p99.9, max and median steps, made of what
    return s


def _slowest(step_us: list, step_kinds_ns: list, res: dict) -> tuple:
    """The steps at or above the p99 of ``step_us`` (indexes), each of KINDS' mean µs in
    them from ``step_kinds_ns`` (per step, ns per kind: they add up to the step), their
    mean lookup calls and their mean µs."""
    cut = pct(step_us, 99)
    slow = [i for i, v in enumerate(step_us) if v >= cut]
    kind_us = {k: sum(step_kinds_ns[i][j] for i in slow) / 1e3 / len(slow)
               for j, k in enumerate(KINDS)}
    lookups = sum(res["step_lookups"][i] for i in slow) / len(slow)
    return slow, kind_us, lookups, sum(step_us[i] for i in slow) / len(slow)


def wake_lateness(late_ns: list | None) -> dict:
    """How late the driver's thread ran again after each step's forward-pass sleep (µs
    past the sleep's end: p50, p99, p99.9, max): the engine thread's wait for a CPU while
    the tier's processes or threads hold the cores, some of it in system calls the kernel
    does not preempt. None for an older result without it."""
    late = [v / 1e3 for v in late_ns or ()]
    return {"wake_us_p50": pct(late, 50), "wake_us_p99": pct(late, 99),
            "wake_us_p999": pct(late, 99.9), "wake_us_max": max(late, default=None)}


def spec_cpu(res: dict) -> dict:
    """The scheduler process's CPU split into the manager's (the spec's) and the driver's
    own: ``spec_cpu_s`` = the main thread's CPU inside the manager's calls (every timed
    region, the drain's calls) + every other thread's CPU (vLLM's I/O threads, shmtier's
    tier-poll and pipe-reader threads). ``driver_cpu_s`` = the rest of the main thread:
    the trace, the driver's bookkeeping, the row fill (the simulated GPU copy) and the
    load checks, the clock reads between calls. What the driver does is the same for both
    managers, so counting it on both sides (``cpu_s``) pulls the ratio towards 1; where
    the manager's threads slow the driver's own code (cache, GIL hand-offs), that cost is
    left with the driver, i.e. not charged to the manager. ``None`` for a result without
    the split (an older JSON)."""
    main = res.get("manager_main_cpu_s")
    if main is None:
        return {"spec_cpu_s": None, "spec_main_cpu_s": None, "driver_cpu_s": None}
    other = res["cpu_s"] - res["main_thread_cpu_s"]
    return {"spec_cpu_s": main + other, "spec_main_cpu_s": main,
            "driver_cpu_s": res["main_thread_cpu_s"] - main}


def cpu_per_kind(s: dict, by_lane: dict | None) -> dict:
    """The CPU of the scheduler process and of the tier workers per process kind (lane),
    user and kernel apart, their sum and the sum per GiB cascaded (issue 29's cost per
    byte): ``total_cpu_s`` = the scheduler process, the driver's own work included, +
    every tier worker (vLLM: its whole process, I/O threads included: it has no other);
    ``spec_total_cpu_s`` = the scheduler process in the manager (``spec_cpu``) + the
    workers. ``s``: the summary so far (``cpu_s``, ``spec_cpu_s``, ``cascaded_gib``);
    ``by_lane``: the driver's ``workers_cpu_by_lane`` (None: no tier workers, or an
    older result)."""
    out = {}
    for lane in ("background", "promotion"):
        v = (by_lane or {}).get(lane)
        out[f"{lane}_workers_user_s"] = v["user"] if v else None
        out[f"{lane}_workers_sys_s"] = v["sys"] if v else None
    out["workers_user_s"] = sum(v["user"] for v in by_lane.values()) if by_lane else None
    out["workers_sys_s"] = sum(v["sys"] for v in by_lane.values()) if by_lane else None
    workers = s.get("workers_cpu_s") or 0.0
    out["total_cpu_s"] = s["cpu_s"] + workers
    out["spec_total_cpu_s"] = (s["spec_cpu_s"] + workers if s.get("spec_cpu_s") is not None
                               else None)
    gib = s.get("cascaded_gib")
    out["total_cpu_s_per_gib"] = out["total_cpu_s"] / gib if gib else None
    out["spec_total_cpu_s_per_gib"] = (out["spec_total_cpu_s"] / gib
                                       if gib and out["spec_total_cpu_s"] is not None else None)
    out["workers_cpu_s_per_gib"] = workers / gib if gib and s.get("workers_cpu_s") else None
    return out


def cascade_yield(counters: dict, fs_hits: int, hit_fs: float, row_bytes: int) -> dict:
    """What the cascades bought (issue 14, "cascade what will be read"): chunks cascaded
    and promoted by the manager's own byte counters (successful jobs x row bytes, the same
    in shmtier and vLLM), promotions per cascaded chunk, logical MiB cascaded per chunk
    the secondary tier served (``fs_hits``: loads whose source was the tier) and the
    secondary hit rate per GiB cascaded."""
    written = counters.get(WRITE_BYTES, 0)
    promoted = counters.get(READ_BYTES, 0)
    return {
        "cascaded_chunks": written / row_bytes, "promoted_by_manager": promoted / row_bytes,
        "cascaded_gib": written / 2 ** 30,
        "promotions_per_cascade": promoted / written if written else None,
        "cascaded_mib_per_fs_hit": written / 2 ** 20 / fs_hits if fs_hits else None,
        "hit_fs_per_gib_cascaded": hit_fs / (written / 2 ** 30) if written else None,
    }


ROWS = [  # (label, key, digits, ratio?)
    ("scheduler-thread time per step", None, 0, False),
    ("  p50 µs", "step_us_p50", 1, True),
    ("  p90 µs", "step_us_p90", 1, True),
    ("  p99 µs", "step_us_p99", 1, True),
    ("  p99.9 µs", "step_us_p999", 0, True),
    ("  max µs", "step_us_max", 0, True),
    ("  mean µs", "step_us_mean", 1, True),
    ("  total over run ms", "manager_ms_total", 0, True),
    ("  on-CPU part (thread_time around the same calls)", None, 0, False),
    ("    p50 µs", "step_cpu_us_p50", 1, True),
    ("    p99 µs", "step_cpu_us_p99", 1, True),
    ("    max µs", "step_cpu_us_max", 0, True),
    ("    mean µs", "step_cpu_us_mean", 1, True),
    ("    p99 of (wall - CPU) µs: descheduled/waiting", "offcpu_us_p99", 1, True),
    ("  steps", "steps", 0, False),
    ("  drain steps", "drain_steps", 0, False),
    ("back from the forward pass late by (wake-up after the step's sleep)", None, 0, False),
    ("  p50 µs", "wake_us_p50", 1, True),
    ("  p99 µs", "wake_us_p99", 1, True),
    ("  p99.9 µs", "wake_us_p999", 0, True),
    ("  max µs", "wake_us_max", 0, True),
    ("CPU over the run (s)", None, 0, False),
    ("  scheduler process in the manager (spec)", "spec_cpu_s", 2, True),
    ("    main thread inside its calls", "spec_main_cpu_s", 2, True),
    ("    other threads (vLLM: its tier I/O)", "other_threads_cpu_s", 2, True),
    ("  scheduler process, all (driver included)", "cpu_s", 2, True),
    ("    main thread", "main_thread_cpu_s", 2, True),
    ("      the driver's own (trace, checks, fill, clocks)", "driver_cpu_s", 2, True),
    ("      of which driver row fill", "fill_cpu_s", 2, False),
    ("    process minus fill", "cpu_excl_fill_s", 2, True),
    ("    kernel (sys) part", "sys_cpu_s", 2, True),
    ("    voluntary context switches", "vol_ctx_switches", 0, True),
    ("    involuntary context switches", "invol_ctx_switches", 0, True),
    ("  tier worker processes", "workers_cpu_s", 2, False),
    ("    background lane user", "background_workers_user_s", 2, False),
    ("    background lane kernel", "background_workers_sys_s", 2, False),
    ("    promotion lane user", "promotion_workers_user_s", 2, False),
    ("    promotion lane kernel", "promotion_workers_sys_s", 2, False),
    ("  scheduler process user part", "user_cpu_s", 2, True),
    ("  scheduler process + tier workers (vLLM: its whole process)", "total_cpu_s", 2, True),
    ("    per GiB cascaded", "total_cpu_s_per_gib", 2, True),
    ("  in the manager (spec) + tier workers", "spec_total_cpu_s", 2, True),
    ("    per GiB cascaded", "spec_total_cpu_s_per_gib", 2, True),
    ("  tier workers per GiB cascaded", "workers_cpu_s_per_gib", 2, False),
    ("promotion (first RETRY/HIT_PENDING -> HIT, per key)", None, 0, False),
    ("  promoted keys", "promo_n", 0, False),
    ("  p50 steps", "promo_steps_p50", 0, True),
    ("  p99 steps", "promo_steps_p99", 0, True),
    ("  p50 ms", "promo_ms_p50", 1, True),
    ("  p99 ms", "promo_ms_p99", 1, True),
    ("  max ms", "promo_ms_max", 1, True),
    ("  probed keys that resolved MISS", "probe_miss_n", 0, True),
    ("  manager's own histogram: promotion job p50 ms", "promo_job_ms_p50", 1, True),
    ("  manager's own histogram: promotion job p99 ms", "promo_job_ms_p99", 1, True),
    ("deferral (steps a request waited on HIT_PENDING/RETRY)", None, 0, False),
    ("  mean", "defer_mean", 2, True),
    ("  p50", "defer_p50", 0, False),
    ("  p99", "defer_p99", 0, True),
    ("  max", "defer_max", 0, True),
    ("  requests deferred at least once", "deferred_frac", 3, True),
    ("  arrival -> admitted p50 steps", "queue_p50", 0, False),
    ("  arrival -> admitted p99 steps", "queue_p99", 0, True),
    ("  most scans in a row losing hits to waiting requests' own promotions",
     "self_eviction_scans_max", 0, False),
    ("  requests given up for that (never admitted)", "abandoned", 0, False),
    ("lookups", None, 0, False),
    ("  calls per run", "lookups", 0, True),
    ("  per step", "lookups_per_step", 1, True),
    ("  per loaded chunk", "lookups_per_loaded_chunk", 2, True),
    ("  share answered HIT_PENDING/RETRY", "pending_frac", 3, True),
    ("hits (share of chunks after the GPU prefix cache)", None, 0, False),
    ("  CPU tier", "hit_cpu", 3, True),
    ("  fs tier", "hit_fs", 3, True),
    ("  recomputed", "miss", 3, True),
    ("  prepare_store -> None (no room)", "alloc_failures", 0, False),
    ("what the cascades bought (manager's byte counters)", None, 0, False),
    ("  chunks cascaded", "cascaded_chunks", 0, True),
    ("  GiB cascaded (logical)", "cascaded_gib", 2, True),
    ("  chunks promoted", "promoted_by_manager", 0, True),
    ("  promotions per cascaded chunk", "promotions_per_cascade", 3, True),
    ("  share of chunk files ever read back", "cascaded_read_back", 3, True),
    ("  MiB cascaded per fs-tier hit", "cascaded_mib_per_fs_hit", 1, True),
    ("  fs hit rate per GiB cascaded", "hit_fs_per_gib_cascaded", 4, True),
    ("manager's own counters over the run (get_stats)", None, 0, False),
    *[(f"  {lbl}", name, 0, False) for lbl, name in MANAGER_COUNTERS],
    ("  shmtier job ring depth, max seen", "ring_depth_max", 0, False),
    ("  shmtier fs page cache bounded (1: yes, at some step)", "page_cache_bounded", 0, False),
    ("  shmtier fs stores O_DIRECT (1: yes, at some step)", "direct_stores", 0, False),
    ("disk", None, 0, False),
    ("  bytes per logical byte", "disk_per_logical", 3, True),
    ("  allocated bytes per logical byte", "disk_alloc_per_logical", 3, True),
    ("  MiB on disk", "disk_mib", 0, True),
    ("  chunk files", "chunk_files", 0, True),
    ("  directories", "dirs", 0, True),
    ("rows checked at load", "verified", 0, False),
    ("  wrong KV served", "wrong_kv", 0, False),
    ("GC in this process during the run (heap frozen first)", None, 0, False),
    ("  collections", "gc_collections", 0, True),
    ("  total ms", "gc_total_ms", 1, True),
    ("  longest ms", "gc_max_ms", 2, True),
    ("wall s (run)", "wall_s", 1, True),
    ("  build s", "build_s", 2, False),
    ("  shutdown s", "shutdown_s", 2, False),
]


def print_table(sums: dict, names: list) -> None:
    w = 26
    others = [n for n in names if n != "vllm"] if "vllm" in names else []
    head = f"{'':<52}" + "".join(f"{label(n):>{w}}" for n in names)
    for n in others:
        head += f"{label(n)[:10] + '/vLLM':>16}"
    print(head)
    for row_label, key, digits, ratio in ROWS:
        if key is None:
            print(row_label)
            continue
        line = f"{row_label:<52}"
        meds = {}
        for n in names:
            mr = med_range([s[key] for s in sums[n]])
            meds[n] = mr[0] if mr else None
            line += f"{fmt_mr(mr, digits, collapse=True):>{w}}"
        for n in others:
            if ratio and meds.get("vllm") and meds.get(n) is not None:
                line += f"{meds[n] / meds['vllm']:>15.2f}x"
            else:
                line += f"{'':>16}"
        print(line)


def _per_manager_table(names: list, head, rows) -> None:
    """A table of one line per row: a 20-wide label, then each manager's columns;
    ``head(n)`` and a row's ``cells(n)`` format manager ``n``'s part."""
    print(f"{'call':<20}" + "".join(head(n) for n in names))
    for row_label, cells in rows:
        print(f"{row_label:<20}" + "".join(cells(n) for n in names))


def print_kinds(sums: dict, names: list) -> None:
    def median(n, field_, kind=None):
        """Manager ``n``'s median over runs of a summary field (of one call kind)."""
        return statistics.median(s[field_] if kind is None else s[field_][kind]
                                 for s in sums[n])

    def time_per_kind(kind):
        def cells(n):
            per_call = [s["per_kind_us_per_call"][kind] for s in sums[n]
                        if s["per_kind_us_per_call"][kind] is not None]
            pc_txt = f"{statistics.median(per_call):.2f}" if per_call else "-"
            return (f"  {median(n, 'per_kind_us_per_step', kind):>19.1f}"
                    f"{median(n, 'per_kind_cpu_us_per_step', kind):>9.1f}"
                    f"{median(n, 'calls_per_run', kind):>7.0f}{pc_txt:>8}")
        return cells

    def slow_vs_all(slow_field, all_field, kind=None):
        return lambda n: (f"  {median(n, slow_field, kind):>22.1f}"
                          f"{median(n, all_field, kind):>8.1f}")

    print("\nwhere the scheduler-thread time goes (median over runs): wall µs per step, on-CPU µs "
          "per step, calls per run, wall µs per call")
    _per_manager_table(
        names, lambda n: f"  {label(n) + ' wall/step':>19}{'cpu/step':>9}{'calls':>7}{'µs/call':>8}",
        [(kind, time_per_kind(kind)) for kind in KINDS])
    print("\nthe slowest 1% of steps (wall >= p99): mean wall µs per kind in those steps vs over all steps")
    _per_manager_table(
        names, lambda n: f"  {label(n) + ' slow steps':>22}{'all':>8}",
        [(kind, slow_vs_all("slow_kind_us", "per_kind_us_per_step", kind)) for kind in KINDS]
        + [("(lookup calls/step)", slow_vs_all("slow_lookups", "all_lookups_per_step"))])


def print_slowest(step_runs: dict, names: list) -> None:
    """The "slowest steps are made of" table per manager, its groups pooled over the runs;
    ``step_runs[n]``: manager ``n``'s runs as driver results (their per-step lists)."""
    for n in names:
        if not step_runs.get(n):
            continue
        runs = step_runs[n]
        print(f"\nthe slowest steps of {label(n)} are made of ({len(runs)} runs pooled; shares of "
              "the group's wall; faults, switches: per step, inside the timed calls)")
        for line in format_table(attribute(runs)):
            print("  " + line)


def print_threads(sums: dict, names: list) -> None:
    """The scheduler process's CPU by thread kind (the driver's ``threads_cpu``), user /
    kernel seconds, median over runs; the main thread is the driver and the manager's
    calls together."""
    print("\nscheduler process CPU by thread (median over runs: user s / kernel s, threads)")
    for n in names:
        runs = [s["threads_cpu"] for s in sums[n] if s.get("threads_cpu")]
        if not runs:
            continue
        kinds = sorted({k for r in runs for k in r})
        cells = []
        for k in kinds:
            user = statistics.median(r[k]["user"] if k in r else 0.0 for r in runs)
            sys_ = statistics.median(r[k]["sys"] if k in r else 0.0 for r in runs)
            threads = max(r[k]["threads"] if k in r else 0 for r in runs)
            cells.append(f"{k} {user:.2f}/{sys_:.2f} ({threads})")
        print(f"  {label(n)}: " + "; ".join(cells))

