"""``shmtier ls`` and ``shmtier top``: what the segments on this host hold, in words.

Runs in: the ``shmtier`` CLI's process. Reads segments only through
``shmtier.shared.snapshot`` (read-only mappings: no lock, no semaphore, no write), so
``top`` may refresh at any rate without slowing an engine. ``top`` redraws with plain
ANSI escapes (no curses, no extra dependency); ``--once`` prints one frame (two samples
``--interval`` apart, for the rates) and ``--json`` prints data instead of text (one JSON
object per frame, one per line when live). A tier type that reports more than the
segment holds (a ``status`` tool in its registry entry, ``shmtier/tiers/registry.py``:
the p2p tier's endpoint sessions, from a status file the endpoint rewrites each second)
adds its entries under its type's name, and their lines to the text; the text of ``ls`` ends
with what a tier type keeps on the host beside the segments (``TierStatus.host``: the node
tier's pools, each with the engines that use it and their hit rates; ``ls --json`` stays
the segments' list, and ``ls --host [--json]`` shows only what the tier types keep). The scheduler's statistics (per tier: chunks, bytes,
lookups, hits, promotions, cascades, backpressure drops, evictions) come from the
segment's stats area, which the scheduler publishes as it steps
(``shmtier/scheduler/stats_publisher.py``); hit rates are shown since the scheduler
started and over the frame's interval. Each tier's line also shows what its tier workers
counted that no result shows, when not zero (symbolic links refused, corrupt chunks they
could not remove, listing errors: the worker slots' counters in the segment, the same
figures as the tier's ``vllm:kv_offload_shmtier_*`` counters). Each tier worker's row
names its lane (``shmtier.shared.lanes``: promotion or background, from the pool config).
"""

from __future__ import annotations

import json
import sys
import time

from shmtier.shared.segment import human_bytes
from shmtier.shared.snapshot import Snapshot, snapshot, snapshots
from shmtier.tiers import registry

# what the tier workers count that no result shows (ring.TIER_COUNTERS), in words
_COUNTER_WORDS = {"links_refused": "links refused",
                  "corrupt_remove_failed": "corrupt chunks not removed",
                  "scan_errors": "listing errors"}


def _tiers_words(s: Snapshot) -> str:
    words = ["cpu"]
    for t in s.tiers:
        if t.type is None:
            words.append(f"tier{t.index}")
            continue
        where = t.where.get("root_dir") or t.where.get("bucket") or t.where.get("pool") or ""
        words.append(f"{t.type}" + (f"({where})" if where else ""))
    return ",".join(words)


def ls_rows(snaps: list[Snapshot]) -> list[dict]:
    """``shmtier ls --json``: one object per segment."""
    out = []
    for s in snaps:
        d = s.as_dict()
        d.pop("workers")
        d["workers"] = len(s.workers)
        d["workers_alive"] = sum(w.alive for w in s.workers)
        out.append(d)
    return out


def ls_text(snaps: list[Snapshot]) -> str:
    """``shmtier ls``: one line per segment."""
    if not snaps:
        return "no shmtier segments on this host"
    width = max(24, *(len(s.engine_id) for s in snaps))  # an id is never cut: users copy it
    head = (f"{'ENGINE':{width}s} {'STATE':6s} {'OWNER':>8s} {'SIZE':>10s} {'ROWS USED':>13s} "
            f"{'ROW':>9s} {'WS':>3s} {'WORKERS':>7s}  TIERS")
    lines = [head]
    for s in snaps:
        state = "live" if s.alive else "STALE"
        rows = f"{s.rows.used}/{s.rows.total}" if s.rows else "-"
        g = s.geometry or {}
        workers = (f"{sum(w.alive for w in s.workers)}/{len(s.workers)}" if s.workers
                   else "-")
        lines.append(f"{s.engine_id:{width}s} {state:6s} {s.owner_pid or s.creator_pid:>8d} "
                     f"{human_bytes(s.size):>10s} {rows:>13s} "
                     f"{human_bytes(g['row_stride']) if g else '-':>9s} "
                     f"{g.get('world_size', '-'):>3} {workers:>7s}  {_tiers_words(s)}"
                     + (f"  ({s.note})" if s.note else ""))
    return "\n".join(lines)


def frame_data(cur: Snapshot, prev: Snapshot | None, status_tools: list | None = None) -> dict:
    """One frame of ``top`` as data: the snapshot, rates against ``prev``, and under
    each tier type's name what its status tool reports (``status_tools``: the
    registry's, ``registry.status_tools()`` when None)."""
    d = cur.as_dict()
    dt = (cur.taken_ns - prev.taken_ns) / 1e9 if prev is not None else 0.0
    rates = {"interval_s": round(dt, 3), "jobs_per_s": None, "gb_per_s": None, "workers": []}
    if prev is not None and dt > 0:
        before = {w.index: w for w in prev.workers}
        tj = tb = 0.0
        for w in cur.workers:
            p = before.get(w.index)
            jobs = max(0, w.jobs - p.jobs) / dt if p else 0.0
            gb = max(0, w.bytes - p.bytes) / dt / 1e9 if p else 0.0
            tj, tb = tj + jobs, tb + gb
            rates["workers"].append({"index": w.index, "jobs_per_s": round(jobs, 2),
                                     "gb_per_s": round(gb, 4)})
        rates["jobs_per_s"], rates["gb_per_s"] = round(tj, 2), round(tb, 4)
    d["rates"] = rates
    for tool in registry.status_tools() if status_tools is None else status_tools:
        d[tool.tier_type] = tool.sessions(cur.engine_id)
    if d["stats"] is not None:
        d["stats"]["tiers"] = _tier_stats(cur, prev)
    return d


def _rate(hits: int | None, lookups: int | None) -> float | None:
    return round(hits / lookups, 4) if hits is not None and lookups else None


def _tier_stats(cur: Snapshot, prev: Snapshot | None) -> list[dict]:
    """The published per-tier statistics, with the CPU tier's chunks and bytes from the
    chunk table, the hit rate since start and over the interval since ``prev`` (None
    where there were no lookups, or ``prev`` holds another publisher's values)."""
    st = cur.stats
    before = {}
    if (prev is not None and prev.stats is not None and prev.stats.pid == st.pid
            and prev.stats.started == st.started):
        before = {t["label"]: t for t in prev.stats.tiers}
    out = []
    for i, t in enumerate(st.tiers):
        t = dict(t)
        if i == 0 and cur.rows is not None and cur.geometry:
            t["chunks"] = cur.rows.used
            t["bytes"] = cur.rows.used * cur.geometry["row_stride"]
        t["hit_rate"] = _rate(t["hits"], t["lookups"])
        p = before.get(t["label"])
        t["interval_hit_rate"] = None
        if p is not None and t["lookups"] is not None and p["lookups"] is not None:
            t["interval_hit_rate"] = _rate(t["hits"] - p["hits"], t["lookups"] - p["lookups"])
        out.append(t)
    return out


def _stats_lines(st: dict | None) -> list[str]:
    """The scheduler's statistics (``frame_data``'s ``stats``) in words."""
    if st is None:
        return []
    head = f"stats  {st['state']}"
    if st["publishes"]:
        head += (f", published {st['age_s']:.2f}s ago by pid {st['pid']} (every "
                 f"{st['interval_s']:g}s, {st['publishes']} publishes)")
    lines = [head + (f"  ({st['note']})" if st["note"] else "")]
    if not st["tiers"]:
        return lines
    lines.append(f"  {'TIER':12s} {'CHUNKS':>8s} {'BYTES':>10s} {'LOOKUPS':>9s} {'HITS':>9s} "
                 f"{'HIT%':>6s} {'NOW%':>6s} {'PROMOTED':>8s} {'CASCADED':>8s} {'FAILED':>6s} "
                 f"{'BP DROP':>7s} {'EVICTED':>8s}")
    num = lambda v: "-" if v is None else str(v)
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}"
    for t in st["tiers"]:
        failed = (None if t["promotion_failures"] is None else
                  t["promotion_failures"] + (t["cascade_failures"] or 0))
        size = "-" if t["bytes"] is None else human_bytes(t["bytes"])
        lines.append(f"  {t['label'][:12]:12s} {num(t['chunks']):>8s} {size:>10s} "
                     f"{num(t['lookups']):>9s} {num(t['hits']):>9s} {pct(t['hit_rate']):>6s} "
                     f"{pct(t['interval_hit_rate']):>6s} {num(t['promotions']):>8s} "
                     f"{num(t['cascades']):>8s} {num(failed):>6s} "
                     f"{num(t['bp_dropped_jobs']):>7s} {num(t['evictions']):>8s}")
    return lines


def frame_text(cur: Snapshot, prev: Snapshot | None, status_tools: list | None = None) -> str:
    """One frame of ``top`` in words."""
    tools = registry.status_tools() if status_tools is None else status_tools
    data = frame_data(cur, prev, tools)
    rates = data["rates"]
    state = "live" if cur.alive else "STALE (owner gone)"
    lines = [f"shmtier top  {cur.engine_id}  {state}  owner pid {cur.owner_pid}  "
             f"generation {cur.generation}  {time.strftime('%H:%M:%S', time.localtime(cur.taken))}"]
    if cur.note:
        lines.append(f"  {cur.note}")
    g = cur.geometry
    if g:
        lines.append(f"arena  {g['num_chunks']} rows x {human_bytes(g['row_stride'])}"
                     f" ({human_bytes(g['arena_bytes'])}), world size {g['world_size']}")
    r = cur.rows
    if r:
        pct = 100.0 * r.used / r.total if r.total else 0.0
        lines.append(f"rows   used {r.used}/{r.total} ({pct:.1f}%)  free {r.free}  "
                     f"pending {r.pending}  ready {r.ready}  pinned {r.pinned}")
    for t in cur.tiers:
        where = " ".join(f"{k}={v}" for k, v in t.where.items())
        counted = "".join(f"  {_COUNTER_WORDS.get(name, name)} {n}"
                          for name, n in t.worker_counters.items() if n)
        lines.append(f"tier {t.index}  {t.type or '(no workers)'}  {where}{counted}")
    if cur.pool:
        p = cur.pool
        total = ("" if rates["jobs_per_s"] is None else
                 f"  {rates['jobs_per_s']:.1f} jobs/s  {rates['gb_per_s']:.3f} GB/s")
        lanes = f" ({p['promotion_workers']} promotion)" if p.get("promotion_workers") else ""
        lines.append(f"pool   {p['mode']}, {p['num_workers']} workers{lanes}, rings "
                     f"{p['slots']} x {p['slot_size']} B{total}")
    if cur.workers:
        per = {w["index"]: w for w in rates["workers"]}
        lines.append(f"  {'W':>2s} {'PID':>8s} {'STATE':6s} {'LANE':10s} {'BEAT':>7s} "
                     f"{'RESTARTS':>8s} {'JOBS':>9s} {'BYTES':>10s} {'CODEC S':>8s} {'FAILED':>6s} "
                     f"{'JOBQ':>5s} {'RESQ':>5s} {'JOBS/S':>8s} {'GB/S':>7s}")
        for w in cur.workers:
            beat = "-" if w.beat_age_s is None else f"{w.beat_age_s:.2f}s"
            st = "alive" if w.alive else ("dead" if w.pid else "none")
            pr = per.get(w.index)
            js = "-" if pr is None else f"{pr['jobs_per_s']:.1f}"
            gs = "-" if pr is None else f"{pr['gb_per_s']:.3f}"
            lines.append(f"  {w.index:>2d} {w.pid:>8d} {st:6s} {w.lane or '-':10s} {beat:>7s} "
                         f"{w.restarts:>8d} {w.jobs:>9d} {human_bytes(w.bytes):>10s} {w.codec_s:>8.2f} "
                         f"{w.failed_keys:>6d} {w.job_depth:>5d} {w.result_depth:>5d} "
                         f"{js:>8s} {gs:>7s}")
    lines.extend(_stats_lines(data["stats"]))
    for tool in tools:
        for session in data[tool.tier_type]:
            lines.extend(tool.lines(session))
    return "\n".join(lines)


def host_entries(status_tools: list | None = None) -> dict[str, list[dict]]:
    """What each tier type keeps on the host beside the segments (``TierStatus.host``:
    the node tier's pools, with the engines that use each and their hit rates), by tier
    type; a type that keeps nothing is left out."""
    out = {}
    for tool in registry.status_tools() if status_tools is None else status_tools:
        entries = tool.host()
        if entries:
            out[tool.tier_type] = entries
    return out


def host_text(entries: dict[str, list[dict]], status_tools: list | None = None) -> str:
    """``host_entries`` in words (``shmtier ls``'s lines after the segments); "" when
    nothing."""
    lines = []
    for tool in registry.status_tools() if status_tools is None else status_tools:
        for entry in entries.get(tool.tier_type, ()):
            lines.extend(tool.lines(entry))
    return "\n".join(lines)


def run_ls(as_json: bool, host: bool = False) -> int:
    """``shmtier ls``: the segments, then what tiers keep beside them; with ``host`` only
    the latter. ``--json``: the segments' list, or with ``host`` ``host_entries``."""
    if host:
        entries = host_entries()
        print(json.dumps(entries, indent=2) if as_json else host_text(entries))
        return 0
    snaps = snapshots()
    if as_json:
        print(json.dumps(ls_rows(snaps), indent=2))
        return 0
    more = host_text(host_entries())
    print(ls_text(snaps) + (f"\n\n{more}" if more else ""))
    return 0


def run_top(engine: str, *, once: bool, as_json: bool, interval: float,
            iterations: int | None = None, out=None) -> int:
    """``shmtier top``: 2 when the engine has no segment, else 0 (after ``iterations``
    frames, or on Ctrl-C)."""
    out = out or sys.stdout
    try:
        prev = snapshot(engine)
    except FileNotFoundError:
        print(f"shmtier top: no segment for engine {engine!r} (`shmtier ls` lists them)",
              file=sys.stderr)
        return 2
    live_text = not once and not as_json
    tools = registry.status_tools()
    shown = 0
    try:
        while True:
            time.sleep(interval)
            try:
                cur = snapshot(engine)
            except FileNotFoundError:
                print(f"shmtier top: the segment of {engine!r} is gone", file=sys.stderr)
                return 0 if shown else 2
            if as_json:
                out.write(json.dumps(frame_data(cur, prev, tools), indent=2 if once else None)
                          + "\n")
            elif live_text:
                out.write("\x1b[H\x1b[2J" + frame_text(cur, prev, tools) + "\n")
            else:
                out.write(frame_text(cur, prev, tools) + "\n")
            out.flush()
            shown += 1
            prev = cur
            if once or (iterations is not None and shown >= iterations):
                return 0
    except KeyboardInterrupt:
        return 0
