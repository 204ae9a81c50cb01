"""``run_stress``: the stress run from start to verdict (the package docstring says what
it does and checks).

Who calls: ``shmtier run`` and ``shmtier bench --stress``, in their main thread, which
plays the scheduler (and a GPU rank); it blocks for the run (seconds to minutes), and
always removes its root, unmounts its tmpfs and leaves nothing in /dev/shm.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid

import numpy as np

from shmtier.shared import procinfo
from shmtier.stress import checks, trace
from shmtier.stress.faults import BIG_FILE_BYTES, mount_tmpfs, unmount
from shmtier.stress.chaos import WRITE_BYTES, Chaos, ChaosRunner, merge_counts, report
from shmtier.stress.engine import LAYOUT, Engine, Totals, arena_mismatches, play, shm_left
from shmtier.stress.invariants import CallTimer, Clock, check_rows
from shmtier.stress.verdict import StressResult
from shmtier.tiers.fs import scheduler as fs_tier
from shmtier.tiers.fs.namespace import namespace_dir_name


def run_stress(conversations: int = 24, turns: int = 4, chunks_per_turn: int = 4,
               cpu_chunks: int = 48, workers: int = 2, seed: int = 0,
               settle_each: bool = False, chaos: Chaos | None = None,
               max_bytes: int | None = None, *, check_every: int = 8,
               call_bound_s: float = 0.5, expected=trace.content,
               result: StressResult | None = None) -> int:
    """Play the trace under ``chaos`` and decide the verdict; returns 0 when every check
    passed and no invariant was broken, else 1. ``result`` (a ``StressResult``) is filled
    with the checks, violations, fault counts and figures.

    ``settle_each``: after every request wait until the tiers are idle (deterministic hit
    counts, for tests). ``max_bytes``: the fs tier's bound. ``check_every``: steps
    between checks of the rows invariant. ``call_bound_s``: the most one manager call may
    take. ``expected``: key -> the bytes its chunk must hold (a test passes a wrong one to
    see the check fail)."""
    for name, value, ok in (("check_every", check_every, check_every >= 1),
                            ("call_bound_s", call_bound_s, call_bound_s > 0),
                            ("conversations", conversations, conversations >= 1),
                            ("turns", turns, turns >= 1)):
        if not ok:
            raise ValueError(f"run_stress {name} = {value!r}: must be positive")
    chaos = chaos or Chaos()
    result = result if result is not None else StressResult()
    result.figures.update({"check_every": check_every, "call_bound_s": call_bound_s})
    clock, totals = Clock(), Totals()
    timer = CallTimer(result, clock, call_bound_s)
    queue = trace.plan(conversations, turns, seed)
    convs = [trace.Conversation(c) for c in range(conversations)]
    max_chunks = turns * chunks_per_turn
    base = tempfile.mkdtemp(prefix="shmtier-run-")
    root, filler, mounted = os.path.join(base, "root"), None, False
    engine_id = f"run-{uuid.uuid4().hex[:8]}"
    extra = {"cpu_bytes_to_use": cpu_chunks * trace.PAGE, "num_tier_workers": workers,
             "secondary_tiers": [{"type": "fs", "root_dir": root, "min_free_bytes": None,
                                  "max_bytes": max_bytes}]}
    engine = None
    first: dict = {}
    corrupted: list = []
    big: list = []
    big_before_fresh: dict = {}
    detected = 0
    ran = False
    started = time.monotonic()
    try:
        if chaos.fill_root_at is not None:
            size = chaos.tmpfs_bytes or conversations * max_chunks * trace.PAGE + (16 << 20)
            why = mount_tmpfs(base, size)
            if why is None:
                mounted, filler = True, os.path.join(base, "filler")
                result.faults["fill_root"] = {"tmpfs_bytes": size}
            else:
                result.faults["fill_root"] = {"skipped": why}
        os.makedirs(root, mode=0o700)
        print(f"shmtier run: engine {engine_id}, CPU tier {cpu_chunks} chunks x "
              f"{trace.PAGE >> 10} KiB, fs tier in {root}"
              f"{' (a tmpfs)' if mounted else ''}, {workers} tier workers")
        print(f"  {conversations} conversations x {turns} turns, +{chunks_per_turn} chunks "
              f"per turn: {len(queue)} requests, working set "
              f"{conversations * max_chunks / cpu_chunks:.1f}x the CPU tier"
              f"{f', fs max_bytes {max_bytes}' if max_bytes is not None else ''}")
        if chaos != Chaos():
            print(f"  chaos (seed {seed}): {chaos}")
        skipped = result.faults.get("fill_root", {}).get("skipped")
        if skipped:
            print(f"  fill the root: skipped: {skipped}")
        start = 0
        if chaos.warm_restart_at is not None:
            from shmtier.stress import restart  # not at import: it is also run as __main__

            start = int(chaos.warm_restart_at * len(queue))
            first = restart.first_scheduler({
                "extra": {**extra, "warm_restart": True}, "engine_id": engine_id,
                "gpu_blocks": 2 * max_chunks, "conversations": conversations, "turns": turns,
                "seed": seed, "chunks_per_turn": chunks_per_turn, "stop": start,
                "chaos": chaos.as_dict(), "root": root, "filler": filler,
                "check_every": check_every, "call_bound_s": call_bound_s})
            _adopt_first(first, totals, timer, clock, result, convs, queue, start,
                         chunks_per_turn)
        engine = Engine({**extra, "warm_restart": chaos.warm_restart_at is not None},
                        engine_id, 2 * max_chunks, result, clock)
        if chaos.warm_restart_at is not None:
            first["restarted_at"] = time.monotonic()
            _check_restart(engine, first, result, expected)
        engine.driver.settle(30.0, sleep_s=0.002)  # tier workers up and the fs root listed
        runner = ChaosRunner(chaos, np.random.default_rng(seed + 1), engine.pool, engine_id,
                             root, len(queue), totals.counters, timer, start, len(queue),
                             filler, namespace=namespace_dir_name(engine.spec.fingerprint),
                             idle_step=engine.idle_step)
        if first.get("chaos", {}).get("fills"):
            runner.written_at_free = 0  # freed in the first scheduler: all of ours count
        play(engine, convs, queue, start, len(queue), chunks_per_turn=chunks_per_turn,
             runner=runner, totals=totals, timer=timer, clock=clock, result=result,
             check_every=check_every, settle_each=settle_each, expected=expected)
        runner.stop()
        counts = merge_counts(first.get("chaos", {}), runner.counts) if first else runner.counts
        corrupted = first.get("corrupted", []) + runner.corrupted
        big = first.get("big", []) + runner.big
        settled = engine.driver.settle(60.0, sleep_s=0.002) is not None
        with engine.driver.locked():
            stats = engine.driver.get_stats()
            gauge = sum(stats.data["data"].get(fs_tier.BYTES_ON_DISK, {}).values())
            indexed = engine.fs.indexed_chunks()
        engine.count(totals, stats)
        if runner.written_at_free is not None:  # the cascades the settling completed too
            counts["written_after_free"] = (totals.counters.get(WRITE_BYTES, 0)
                                            - runner.written_at_free)
        runner.note_written()  # so do those after the namespace link was removed
        counts["written_after_link"] = (first.get("chaos", {}).get("written_after_link", 0)
                                        + runner.counts["written_after_link"])
        pinned, pending = check_rows(engine_id, engine.ledger, result, clock, engine.manager.lock)
        _report(totals, timer, clock, time.monotonic() - started)
        if chaos != Chaos():
            print(report(counts))
            print(f"fs tier: {engine.fs.namespace_resets} results flagged NAMESPACE_RESET "
                  f"(the index dropped and the root listed again)")
        result.faults.update(_faults(chaos, counts, result.faults.get("fill_root")))
        print("checks")
        result.check("no wrong byte served", totals.wrong_bytes == 0,
                     f"wrong bytes served: {totals.wrong_bytes} in {totals.chunks_loaded} "
                     f"loaded chunks", wrong_bytes=totals.wrong_bytes,
                     chunks_loaded=totals.chunks_loaded)
        result.check("tiers settled", settled, f"tiers settled (no pending work) after the "
                     f"trace: {'yes' if settled else 'NO'}")
        _check_invariants(result, engine, first, timer, pinned, pending)
        if counts.get("stalls"):
            result.check("calls bounded while a worker stalled",
                         counts["stall_max_call_ms"] <= call_bound_s * 1e3,
                         f"slowest manager call while a tier worker was stopped: "
                         f"{counts['stall_max_call_ms']:.1f} ms (bound "
                         f"{call_bound_s * 1e3:.0f} ms; stalled {chaos.stall_s:g} s each)",
                         stall_max_call_ms=counts["stall_max_call_ms"])
        if counts.get("fills") and runner.root_back_at_end:
            why = ("not judged: the fs root was removed before the free and made again only "
                   "when the trace ended (nothing was left to store; a shorter root_gone_s "
                   "or a longer trace judges it)")
            result.faults["fill_root"]["resume_check"] = why
            print(f"  [--] stores work after the root is freed: {why}")
        elif counts.get("fills"):
            result.check("stores work after the root is freed", counts["written_after_free"] > 0,
                         f"fs root filled {counts['fills']}x ({counts['filled_bytes']} bytes); "
                         f"cascades failed meanwhile "
                         f"{totals.counters.get('vllm:kv_offload_tiering_cascade_job_failures', 0)}"
                         f"; bytes cascaded after it was freed {counts['written_after_free']}",
                         written_after_free=counts["written_after_free"])
        if counts.get("namespace_links"):
            _check_link(result, counts, engine,
                        runner.link_removed_at_end or first.get("link_removed_at_end", False))
        damaged = checks.damaged_left(corrupted)
        big_before_fresh = checks.big_left(big)
        checks.check_index(result, root, "live engine", indexed, gauge, max_bytes,
                           damaged=damaged, foreign=big_before_fresh)
        detected = int(totals.counters.get(fs_tier.CORRUPT_CHUNKS, 0))
        ran = True
    finally:
        if engine is not None:
            engine.close()
        if not ran:  # an error on the way: clean up before it propagates
            _clean(base, mounted, engine_id, result)
    try:  # the trace ran: the damaged files, then a fresh engine's scan
        if corrupted:
            checks.check_damaged(result, root, corrupted, detected)
        try:
            checks.fresh_scan(result, extra, LAYOUT, root, max_bytes)
        except Exception as e:  # a check that cannot run fails
            result.check("fresh engine's scan", False, f"fresh engine's scan: {e!r}")
        if big:
            left = checks.big_left(big)
            result.check("files too big for a chunk removed", not left,
                         f"chunk files replaced by sparse {BIG_FILE_BYTES >> 30} GiB files: "
                         f"{len(big)}; gone by the end of the trace (the tier took them for "
                         f"foreign files, or they went with the namespace) "
                         f"{len(big) - len(big_before_fresh)}; removed by a fresh engine's "
                         f"listing {len(big_before_fresh) - len(left)}; left {len(left)}",
                         planted=len(big), gone_in_run=len(big) - len(big_before_fresh),
                         left_at_end=len(big_before_fresh), left=len(left))
    finally:
        _clean(base, mounted, engine_id, result)
    left = shm_left(engine_id)
    print(f"segment and ring semaphores removed on shutdown: {'yes' if not left else left}")
    if left:
        result.check("nothing left in /dev/shm", False, f"left in /dev/shm: {left}")
    result.figures.update({"wall_s": time.monotonic() - started, "steps": clock.step,
                           "latency": timer.figures(), "totals": totals.as_dict()})
    failed = result.failed + sorted(result.violation_counts)
    print(f"all checks passed: {'yes' if result.passed else 'NO: ' + ', '.join(failed)}")
    return result.exit_code


def _check_link(result: StressResult, counts: dict, engine: Engine, at_end: bool) -> None:
    """The namespace-link fault: the worker killed under the link was replaced (its
    replacement started with the link in place), the pool never broke, and cascades landed
    once the link was gone (not judged when it went only as the trace ended, nor the
    restart when no worker was ever healthy to be killed under the link)."""
    c = counts
    broken = engine.pool.broken
    if not c["link_kills"] and broken is None and not c["link_pool_broken"]:
        why = ("not judged: no tier worker was healthy to be killed while the link was in "
               "place (the pool is not broken)")
        result.faults.setdefault("namespace_link", {})["restart_check"] = why
        print(f"  [--] tier workers start under a namespace link: {why}")
    else:
        replaced = (c["link_replacements_healthy"] == c["link_kills"]
                    and not c["link_pool_broken"])
        result.check("tier workers start under a namespace link", replaced and broken is None,
                     f"namespace replaced by a symlink {c['namespace_links']}x: tier workers "
                     f"SIGKILLed under it {c['link_kills']}, replaced and healthy "
                     f"{c['link_replacements_healthy']}; pool broken: "
                     f"{'no' if broken is None else broken}",
                     links=c["namespace_links"], kills=c["link_kills"],
                     replaced=c["link_replacements_healthy"], pool_broken=broken is not None)
    if at_end:
        why = ("not judged: the link was removed only when the trace ended (nothing was left "
               "to store)")
        result.faults.setdefault("namespace_link", {})["resume_check"] = why
        print(f"  [--] stores work after the namespace link is removed: {why}")
        return
    result.check("stores work after the namespace link is removed", c["written_after_link"] > 0,
                 f"namespace link removed {c['namespace_links_removed']}x (the directory put "
                 f"back {c['namespace_dirs_put_back']}x); bytes cascaded after it "
                 f"{c['written_after_link']}", written_after_link=c["written_after_link"])


def _clean(base: str, mounted: bool, engine_id: str, result: StressResult) -> None:
    """Remove the root (and unmount its tmpfs) and what a killed scheduler left."""
    from shmtier.shared.ring_tools import clean_stale_ring_semaphores
    from shmtier.shared.segment import segment_name
    from shmtier.shared.segment_tools import clean_stale_segments

    if mounted:
        why = unmount(base)
        if why is not None:
            result.check("tmpfs unmounted", False, why)
    shutil.rmtree(base, ignore_errors=True)
    names = {segment_name(engine_id)}
    clean_stale_segments(names)
    clean_stale_ring_semaphores(names)


def _adopt_first(first: dict, totals: Totals, timer: CallTimer, clock: Clock,
                 result: StressResult, convs: list, queue: list[int], stop: int,
                 chunks_per_turn: int) -> None:
    """Take over the first scheduler's figures and where it left the trace."""
    totals.add(first["totals"])
    timer.step_us += first["step_us"]
    timer.call_s += first["call_s"]
    clock.step = first["steps"]
    result.merge_violations(first["result"])
    for cid in queue[:stop]:
        convs[cid].chunks += chunks_per_turn
    rows = first["rows_at_kill"]
    print(f"  first scheduler (pid {first['killed_pid']}) SIGKILLed after request {stop} of "
          f"{len(queue)}: {rows['resident']} chunks resident, {rows['pinned']} rows pinned and "
          f"{rows['pending']} pending by work in flight; {len(first['old_workers'])} of its "
          f"tier workers still running as the new scheduler re-attaches at once")


def _check_restart(engine: Engine, first: dict, result: StressResult, expected) -> None:
    """The new scheduler re-attached to the dead one's segment and kept its ready rows,
    byte for byte. A segment another process removed before the restart (``shmtier
    clean``, or a test suite's clean-up, elsewhere on this host: a stale segment is theirs
    to remove) leaves nothing to re-attach to: the fault is skipped, with that reason."""
    segment = engine.manager.primary.segment
    rows, bad = arena_mismatches(engine, expected)
    kept = first["rows_at_kill"]["resident"]
    print("warm restart")
    if not first["segment_present"]:
        why = ("the killed scheduler's stale segment was removed by another process on this "
               "host (shmtier clean) before the restart")
        print(f"  warm restart: skipped: {why}")
        result.faults["warm_restart"] = {"skipped": why, "killed_pid": first["killed_pid"]}
        return
    old = _old_workers_gone(engine, first)
    result.check("warm restart: old tier workers gone", not old["running"],
                 f"warm restart: new engine up {old['restarted_after_s']:.2f} s after the "
                 f"kill; the killed scheduler's {old['old_workers']} tier workers "
                 f"running at the restart are gone: "
                 f"{'yes' if not old['running'] else 'NO: pids %s' % old['running']} "
                 f"({old['old_slots_left']} left their slots on seeing the new owner, "
                 f"{old['old_slots_killed']} killed by the new pool)", **old)
    result.check("warm restart: segment kept", not segment.is_creator and 0 < rows <= kept,
                 f"warm restart: re-attached to the segment: "
                 f"{'yes' if not segment.is_creator else 'NO (made a new one)'}; "
                 f"{rows} chunks kept of {kept} resident at the kill (pending writes freed)",
                 rows_kept=rows, resident_at_kill=kept)
    result.check("warm restart: kept rows byte-exact", bad == 0,
                 f"warm restart: kept rows whose bytes differ from their chunk: {bad} of {rows}",
                 rows=rows, wrong=bad)
    result.faults["warm_restart"] = {"killed_pid": first["killed_pid"], "rows_kept": rows,
                                     "resident_at_kill": kept, **old}


def _old_workers_gone(engine: Engine, first: dict, wait_s: float = 3.0) -> dict:
    """The first scheduler's tier workers once the new engine is up: its pool waited for
    (or killed) those holding slots; one that was still starting leaves on its own when it
    sees the new owner generation (waited for up to ``wait_s``)."""
    boot = procinfo.boot_id()
    old = [(pid, start) for pid, start in first["old_workers"]]
    deadline = time.monotonic() + wait_s
    while (running := [pid for pid, start in old if procinfo.is_alive(pid, start, boot)]) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    holders = engine.pool.old_holders if engine.pool is not None else []
    return {"old_workers": len(old), "running": running,
            "restarted_after_s": first["restarted_at"] - first["killed_at"],
            "old_slots_left": sum(not h.killed for h in holders),
            "old_slots_killed": sum(h.killed for h in holders)}


def _check_invariants(result: StressResult, engine: Engine, first: dict, timer: CallTimer,
                      pinned: int, pending: int) -> None:
    """The end of the continuous checks: what each invariant saw over the run."""
    ledger = engine.ledger.counts()
    before = first.get("ledger", {})
    cut = before.get("tier_in_flight", 0)
    lat = timer.figures()
    n = result.violation_counts
    result.check("jobs exactly once", not n.get("jobs exactly once") and not ledger["tier_in_flight"]
                 and not ledger["pool_in_flight"],
                 f"jobs exactly once: fs tier {ledger['tier_submitted'] + before.get('tier_submitted', 0)} "
                 f"submitted, {ledger['tier_completed'] + before.get('tier_completed', 0)} completed"
                 f"{f' ({cut} cut off by the scheduler kill)' if first else ''}, "
                 f"{ledger['tier_in_flight']} lost; worker pool "
                 f"{ledger['pool_submitted'] + before.get('pool_submitted', 0)} submitted, "
                 f"{ledger['pool_completed'] + before.get('pool_completed', 0)} completed, "
                 f"{ledger['pool_in_flight']} lost; reported twice or unknown: "
                 f"{n.get('jobs exactly once', 0)}", **ledger)
    result.check("rows and pins", not n.get("rows and pins") and pinned == 0 and pending == 0,
                 f"rows and pins vs jobs in flight, every {result.figures.get('check_every', '?')} "
                 f"steps: {n.get('rows and pins', 0)} violations; after settling {pinned} "
                 f"pinned, {pending} pending", violations=n.get("rows and pins", 0),
                 pinned=pinned, pending=pending)
    result.check("call latency", not n.get("call latency"),
                 f"manager call latency: {lat['calls']} calls, p50 {lat['p50_us']:.0f} us, p99 "
                 f"{lat['p99_us']:.0f} us, max {lat['max_us'] / 1e3:.1f} ms; over the "
                 f"{lat['bound_ms']:.0f} ms bound: {n.get('call latency', 0)}", **lat)
    for v in result.violations:
        print(f"    violation at step {v.step} (request {v.request}): {v.check}: {v.what}")


def _faults(chaos: Chaos, c: dict, fill: dict | None) -> dict:
    """Per fault kind, what was asked and what was done (verdict ``faults``)."""
    from shmtier.stress.faults import CORRUPTIONS

    out = {"kill_workers": {"every_s": chaos.kill_every_s, "kills": c["kills"],
                            "none_healthy": c["no_worker_to_kill"]},
           "delete_namespace": {"at": list(chaos.delete_namespace_at),
                                "done": c["namespace_deletions"]},
           "delete_root": {"at": list(chaos.delete_root_at), "done": c["root_deletions"],
                           "files_deleted": c["files_deleted"]},
           "corrupt_files": {"at": list(chaos.corrupt_at), "events": c["corrupt_events"],
                             **{h: c[f"corrupted_{h}"] for h in CORRUPTIONS}},
           "stall_worker": {"at": list(chaos.stall_at), "stall_s": chaos.stall_s,
                            "stalls": c["stalls"], "resumed": c["stalls_resumed"],
                            "killed_as_hung": c["stalls_killed_as_hung"],
                            "max_call_ms": c["stall_max_call_ms"]}}
    if chaos.big_file_at:
        out["big_files"] = {"at": list(chaos.big_file_at), "events": c["big_file_events"],
                            "planted": c["big_files_planted"]}
    if chaos.namespace_link_at:
        out["namespace_link"] = {"at": list(chaos.namespace_link_at), "for": chaos.link_for,
                                 "links": c["namespace_links"],
                                 "not_made": c["namespace_links_skipped"],
                                 "kills": c["link_kills"],
                                 "replaced": c["link_replacements_healthy"],
                                 "pool_broken": c["link_pool_broken"],
                                 "put_back": c["namespace_dirs_put_back"],
                                 "written_after_link": c["written_after_link"]}
    if chaos.fill_root_at is not None:
        out["fill_root"] = {**(fill or {}), "at": chaos.fill_root_at, "for": chaos.fill_for,
                            "fills": c["fills"], "filled_bytes": c["filled_bytes"],
                            "written_after_free": c["written_after_free"]}
    return out


def _report(t: Totals, timer: CallTimer, clock: Clock, elapsed: float) -> None:
    c = t.counters
    lookups = t.chunks_loaded + t.chunks_computed
    written = c.get("vllm:kv_offload_tiering_write_bytes", 0)
    stored = c.get(fs_tier.STORED_RATIO, 0)
    steps = np.array(timer.step_us) if timer.step_us else np.zeros(1)
    print(f"\nfinished in {elapsed:.1f} s, {clock.step} scheduler steps ({t.deferred_steps} deferred)")
    print("hit rates (chunks of the prompts)")
    print(f"  CPU tier   {t.lookups_hit_cpu:6d}  ({t.lookups_hit_cpu / max(lookups, 1):.0%})")
    print(f"  fs tier    {t.lookups_promoted:6d}  ({t.lookups_promoted / max(lookups, 1):.0%}, promoted)")
    print(f"  computed   {t.chunks_computed:6d}  ({t.chunks_computed / max(lookups, 1):.0%}; "
          f"{t.store_refused} of them not offloaded: no free CPU row)")
    print("bytes moved")
    print(f"  CPU -> fs (cascades)   {written / 2**20:8.1f} MiB logical, {stored / 2**20:.1f} MiB on disk"
          f" (compression {written / stored if stored else 1:.2f}x)")
    print(f"  fs -> CPU (promotions) {c.get('vllm:kv_offload_tiering_read_bytes', 0) / 2**20:8.1f} MiB")
    print(f"  checksum failures {c.get(fs_tier.CORRUPT_CHUNKS, 0)}, worker restarts "
          f"{c.get(fs_tier.WORKER_RESTARTS, 0)}")
    print("scheduler-thread time in manager calls per step (µs)")
    print(f"  p50 {np.percentile(steps, 50):.0f}   p99 {np.percentile(steps, 99):.0f}   "
          f"max {steps.max():.0f}")
    print(f"loaded chunks identical to what was offloaded: {'yes' if t.wrong_bytes == 0 else 'NO'}"
          f" ({t.chunks_loaded} chunks)")
