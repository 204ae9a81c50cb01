"""What ``shmtier bench`` writes: ``report.json`` (every run's summary, the machine's
limits, the ratios), ``report.md`` (the same as tables: median [min-max] over runs per
manager, the shmtier/vLLM ratio per run pair as median [min-max], figures as fractions of
the machine's limits) and PNG plots when matplotlib is importable (step-time CDFs, hit
rate per tier over time, bytes per tier over time); without it the report says
"plots skipped" and why.
"""

from __future__ import annotations

import json
import os
import statistics

from shmtier.bench.common import fmt_mr, med_range, pct
from shmtier.bench.report import ROWS, label

GB = 1e9

# (label, key, digits, ratio?, limit key or None): rows the bench adds to report.ROWS
EXTRA_ROWS = [
    ("scheduler-thread time per step, tail", None, 0, False, None),
    ("  p99.9 µs", "step_us_p999", 1, True, None),
    ("throughput over the run's wall time (the tiers' offered load)", None, 0, False, None),
    ("  cascade GB/s (chunks written to the fs tier)", "cascade_gbps", 3, True, "disk_write_gbps"),
    ("  promotion GB/s (chunks loaded from the fs tier)", "promo_gbps", 3, True, "disk_read_gbps"),
    ("  tier-worker GB/s per CPU second (cascade + promotion)", "worker_gbps_per_cpu_s", 3,
     False, "codec_encode_gbps_per_core"),
    ("  driver row fill GB/s per CPU second (the simulated GPU copy)", "fill_gbps_per_cpu_s", 2,
     False, "memcpy_gbps"),
    ("memory", None, 0, False, None),
    ("  scheduler process peak RSS MiB (VmHWM, this run)", "peak_rss_mib", 0, True, None),
    ("  tier worker peak RSS MiB (max over workers)", "worker_peak_rss_mib_max", 0, False, None),
    ("verification", None, 0, False, None),
    ("  loaded chunks checked byte for byte", "verified", 0, False, None),
    ("  GB checked", "verified_gb", 3, False, None),
]
RATIO_KEYS = ("step_us_p50", "step_us_p90", "step_us_p99", "step_us_p999", "step_us_max",
              "cpu_s", "total_cpu_s", "promo_ms_p50", "promo_steps_p50", "defer_mean", "hit_fs",
              "disk_per_logical", "peak_rss_mib")


def extend_summary(s: dict, res: dict, chunk_bytes: int, limits: dict | None) -> dict:
    """Add the bench's figures to one run's ``report.summarise`` output."""
    steps_us = [v / 1e3 for v in res["step_ns"]]
    s["step_us_p999"] = pct(steps_us, 99.9)
    wall = res["wall_s"] or 1e-9
    cascaded = res["disk"]["chunk_files"] * chunk_bytes  # fs unbounded: every cascade is a file
    promoted = sum(v for k, v in res["loaded"].items() if k != "host") * chunk_bytes
    s["cascade_gbps"] = cascaded / wall / GB
    s["promo_gbps"] = promoted / wall / GB
    s["promoted_chunks"] = promoted // chunk_bytes
    wcpu = res.get("workers_cpu_s")
    s["worker_gbps_per_cpu_s"] = (cascaded + promoted) / wcpu / GB if wcpu else None
    s["fill_gbps_per_cpu_s"] = (res["stored_chunks"] * chunk_bytes / res["fill_cpu_s"] / GB
                                if res["fill_cpu_s"] else None)
    s["peak_rss_mib"] = res.get("peak_rss_mib")
    hwm = [x for x in res.get("worker_peak_rss_mib") or [] if x is not None]
    s["worker_peak_rss_mib_max"] = max(hwm) if hwm else None
    s["verified_gb"] = res.get("verified_bytes", 0) / GB
    s["wrong_by_source"] = res.get("wrong_by_source", {})
    s["backpressure_drops"] = s.get("vllm:kv_offload_tiering_backpressure_stores_dropped", 0)
    if limits:
        s["fraction_of_limit"] = {
            key: (s[key] / limits[lim] if s.get(key) is not None and limits.get(lim) else None)
            for _, key, _, _, lim in EXTRA_ROWS if key and lim}
    # time series for the JSON (plots are drawn from the raw results)
    s["step_us_cdf"] = [pct(steps_us, q / 10) for q in range(0, 1001, 5)]
    s["hits_over_time"] = _binned_hits(res["step_hits"], 40)
    s["bytes_over_time"] = [{"step": st, "fs_bytes": b, "cpu_rows_filled_bytes": rows * chunk_bytes}
                            for st, b, rows in res.get("samples", [])]
    return s


def _binned_hits(step_hits: list, bins: int) -> list:
    """Hit shares per tier over ``bins`` equal spans of steps."""
    n = len(step_hits)
    if not n:
        return []
    out = []
    width = max(1, -(-n // bins))
    for i in range(0, n, width):
        part = step_hits[i:i + width]
        elig = sum(p[0] for p in part)
        out.append({"step": i, "eligible": elig,
                    "cpu": sum(p[1] for p in part) / elig if elig else None,
                    "fs": sum(p[2] for p in part) / elig if elig else None})
    return out


def _ratios(sums: dict, names: list) -> dict:
    """Per non-vLLM manager and key: the ratio to vLLM per run pair (repeat r of each),
    median [min-max]."""
    if "vllm" not in names:
        return {}
    out = {}
    for n in names:
        if n == "vllm":
            continue
        per = {}
        for key in RATIO_KEYS:
            pairs = [a[key] / b[key] for a, b in zip(sums[n], sums["vllm"])
                     if a.get(key) is not None and b.get(key)]
            mr = med_range(pairs)
            per[key] = ({"median": mr[0], "min": mr[1], "max": mr[2], "pairs": pairs}
                        if mr else None)
        out[n] = per
    return out


def _verification(sums: dict) -> dict:
    checked = sum(s["verified"] for runs in sums.values() for s in runs)
    wrong = sum(s["wrong_kv"] for runs in sums.values() for s in runs)
    per = {n: {"checked": sum(s["verified"] for s in runs), "wrong": sum(s["wrong_kv"] for s in runs),
               "promoted_checked": sum(s["promoted_chunks"] for s in runs)}
           for n, runs in sums.items()}
    passed = wrong == 0 and checked > 0
    parts = ", ".join(f"{label(n)} {v['checked']} (of which {v['promoted_checked']} promoted)"
                      for n, v in per.items())
    text = (f"{'PASSED' if passed else 'FAILED'}: {checked} loaded chunks checked byte for byte "
            f"({parts}), {wrong} wrong")
    return {"passed": passed, "checked": checked, "wrong": wrong, "per_manager": per, "text": text}


def write_reports(out_dir: str, meta: dict, limits: dict | None, sums: dict, raws: dict,
                  plots: bool = True) -> dict:
    names = list(sums)
    ratios = _ratios(sums, names)
    verification = _verification(sums)
    ratio_lines = []
    for n, per in ratios.items():
        def r(key):
            v = per.get(key)
            return f"{v['median']:.2f}x [{v['min']:.2f}-{v['max']:.2f}]" if v else "-"
        ratio_lines.append(f"{label(n)}/{label('vllm')} step time: p50 {r('step_us_p50')}, p99 "
                           f"{r('step_us_p99')}, p99.9 {r('step_us_p999')}; process CPU "
                           f"{r('cpu_s')}, with the tier workers {r('total_cpu_s')}; "
                           f"promotion p50 {r('promo_ms_p50')}")
    if plots:
        written, plots_text = _plots(out_dir, sums, raws)
    else:
        written, plots_text = [], "plots skipped: --no-plots"
    report = {**meta, "limits": limits, "verification": verification, "ratios": ratios,
              "ratio_lines": ratio_lines, "plots": written, "plots_text": plots_text,
              "runs": sums}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(_markdown(report, names))
    return report


def _cell(values, digits) -> str:
    return fmt_mr(med_range(values), digits, collapse=True)


def _markdown(rep: dict, names: list) -> str:
    sums, limits, ratios = rep["runs"], rep["limits"], rep["ratios"]
    others = [n for n in names if n != "vllm"] if "vllm" in names else []
    cfg = rep["config"]
    lines = [f"# shmtier bench: {', '.join(label(n) for n in names)}", "",
             f"- started {rep['started']}, python {rep['python']} on {rep['machine']}, "
             f"{rep['cpus']} CPUs, load average {rep['load_avg_start']:.2f} at start, "
             f"{rep['load_avg_end']:.2f} at end",
             f"- {rep['vllm']}",
             f"- **vLLM baseline: {rep['baseline']['baseline'] or 'none'}**; the driver makes the "
             f"{rep['baseline']['replay']}",
             f"- trace: {rep['trace_text']}" + (f" (from {rep['trace_file']})" if rep['trace_file'] else ""),
             f"- chunk {cfg['chunk_bytes'] >> 10} KiB, CPU tier {cfg['cpu_mib']} MiB "
             f"({cfg['capacity_chunks']} chunks) for every manager, fs tier unbounded in a fresh "
             f"temp dir under {cfg['dir']}, step {cfg['step_ms']:g} ms, up to {cfg['max_running']} "
             f"running requests offering {cfg['batch']} chunks per step, shmtier: "
             f"{cfg['workers']} tier workers, compression {cfg['compression'] or 'default'}"
             + (f"; busy host: {cfg['busy']} process(es) spinning at niceness "
                f"{rep.get('busy', {}).get('niceness')} through every run" if cfg.get("busy")
                else ""),
             f"- {rep['repeats']} run(s) per manager, alternated (order rotated per repeat); "
             "cells: median [min-max] over runs; ratios: per run pair, median [min-max]",
             f"- **verification: {rep['verification']['text']}**"]
    lines += [f"- **run {st['run_no']} of {label(st['manager'])} made no progress and was run "
              f"again** (not in the figures): {st['error']}" for st in rep.get("stalls", ())]
    lines += [f"- **{label(n)} run {i + 1} gave up request {a['req']}** after {a['scans']} lookup "
              f"scans in a row ({a['why']}; arrived at step {a['arrival_step']}, given up at "
              f"{a['step']}): not admitted, so not in its hit and load figures"
              for n in names for i, s in enumerate(sums[n])
              for a in s.get("abandoned_requests", ())]
    lines.append("")
    if limits:
        lines += ["## This machine's limits (measured in this run)", "",
                  "| limit | GB/s |", "|---|---|",
                  f"| memcpy (one core) | {limits['memcpy_gbps']:.2f} |",
                  f"| codec encode per core (ratio {limits['codec_ratio']:.2f}) | "
                  f"{limits['codec_encode_gbps_per_core']:.2f} |",
                  f"| codec decode per core | {limits['codec_decode_gbps_per_core']:.2f} |",
                  f"| disk write (fsync) | {limits['disk_write_gbps']:.2f} |",
                  f"| disk read (pages dropped) | {limits['disk_read_gbps']:.2f} |", ""]
    else:
        lines += ["Machine limits not measured (--no-limits).", ""]
    head = "| figure | " + " | ".join(label(n) for n in names)
    head += "".join(f" | {label(n)}/{label('vllm')}" for n in others) + " | of the limit |"
    lines += ["## Results", "", head, "|" + "---|" * (2 + len(names) + len(others))]
    rows = [(lbl, key, d, ratio, None) for lbl, key, d, ratio in ROWS] + EXTRA_ROWS
    for lbl, key, digits, ratio, lim in rows:
        if key is None:
            lines.append(f"| **{lbl.strip()}** |" + " |" * (1 + len(names) + len(others)))
            continue
        cells = [_cell([s.get(key) for s in sums[n]], digits) for n in names]
        for n in others:
            pairs = [a[key] / b[key] for a, b in zip(sums[n], sums["vllm"])
                     if ratio and a.get(key) is not None and b.get(key)]
            cells.append(_cell(pairs, 2) + ("x" if pairs else ""))
        frac = ""
        if lim and limits:
            parts = []
            for n in names:
                fr = [s.get("fraction_of_limit", {}).get(key) for s in sums[n]]
                if any(v is not None for v in fr):
                    parts.append(f"{label(n)} {_cell(fr, 3)} of {lim}")
            frac = "; ".join(parts)
        lines.append(f"| {lbl.strip()} | " + " | ".join(cells) + f" | {frac} |")
    lines += [""]
    if rep["ratio_lines"]:
        lines += ["## Ratios", ""] + [f"- {x}" for x in rep["ratio_lines"]] + [""]
    lines += ["## Plots", ""]
    if rep["plots"]:
        lines += [f"![{p}]({p})" for p in rep["plots"]]
    else:
        lines.append(rep["plots_text"])
    return "\n".join(lines) + "\n"


def _plots(out_dir: str, sums: dict, raws: dict) -> tuple[list, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return [], f"plots skipped: matplotlib not importable ({type(e).__name__}: {e})"
    written = []
    names = list(sums)
    # step-time CDFs, every run of every manager
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in names:
        for i, res in enumerate(raws[n]):
            v = sorted(x / 1e3 for x in res["step_ns"])
            ys = [(k + 1) / len(v) for k in range(len(v))]
            ax.plot(v, ys, label=f"{label(n)} run {i + 1}", alpha=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("scheduler-thread time per step (µs, log)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("step-time CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, plt, out_dir, "step_time_cdf.png"))
    # hit rate per tier over time (first run of each manager)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in names:
        hits = sums[n][0]["hits_over_time"]
        xs = [h["step"] for h in hits if h["eligible"]]
        ax.plot(xs, [h["cpu"] for h in hits if h["eligible"]], label=f"{label(n)} CPU tier")
        ax.plot(xs, [h["fs"] for h in hits if h["eligible"]], "--", label=f"{label(n)} fs tier")
    ax.set_xlabel("engine step")
    ax.set_ylabel("hit share of eligible chunks")
    ax.set_title("hit rate per tier over time (run 1)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, plt, out_dir, "hit_rate_over_time.png"))
    # bytes per tier over time
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in names:
        pts = sums[n][0]["bytes_over_time"]
        xs = [p["step"] for p in pts]
        ax.plot(xs, [p["fs_bytes"] / 2 ** 20 for p in pts], label=f"{label(n)} fs tier on disk")
        ax.plot(xs, [p["cpu_rows_filled_bytes"] / 2 ** 20 for p in pts], ":",
                label=f"{label(n)} CPU tier rows written")
    ax.set_xlabel("engine step")
    ax.set_ylabel("MiB")
    ax.set_title("bytes per tier over time (run 1)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, plt, out_dir, "bytes_over_time.png"))
    return written, f"{len(written)} written: {', '.join(written)}"


def _save(fig, plt, out_dir: str, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=100)
    plt.close(fig)
    return name


def median_of(sums: list, key: str):
    values = [s[key] for s in sums if s.get(key) is not None]
    return statistics.median(values) if values else None
