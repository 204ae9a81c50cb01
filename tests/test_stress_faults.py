"""``shmtier run``'s stress faults (``shmtier/stress/``), each in a short run: injected,
counted, visible in the verdict, and the verdict passes; and a check that can fail does
(a wrong expected byte gives FAIL with the step and the reason)."""

from __future__ import annotations

import os

import pytest

from shmtier.stress import Chaos, StressResult, run_stress
from shmtier.stress import trace

SMALL = dict(conversations=8, turns=3, chunks_per_turn=4, cpu_chunks=12, workers=2)


def _run(chaos: Chaos, **kw) -> tuple[int, StressResult]:
    before = set(os.listdir("/dev/shm"))
    result = StressResult()
    rc = run_stress(**{**SMALL, **kw}, chaos=chaos, result=result)
    assert not {e for e in set(os.listdir("/dev/shm")) - before if e.startswith("shmtier_run-")}
    return rc, result


def _check(result: StressResult, name: str):
    return next(c for c in result.checks if c.name == name)


def _passed(rc: int, result: StressResult) -> None:
    assert rc == 0 and result.passed, (result.failed, result.violations)
    for name in ("no wrong byte served", "jobs exactly once", "rows and pins", "call latency",
                 "live engine: bytes", "fresh engine: orphans"):
        assert _check(result, name).ok


def test_corrupt_files_are_never_served_and_accounted(capsys):
    rc, result = _run(Chaos(corrupt_at=(0.3, 0.6, 0.9), corrupt_files=3), seed=1)
    _passed(rc, result)
    f = result.faults["corrupt_files"]
    assert f["events"] == 3 and f["flip"] + f["truncate"] + f["header"] >= 6
    damaged = _check(result, "damaged files accounted").counts
    assert damaged["damaged"] == f["flip"] + f["truncate"] + f["header"]
    assert damaged["detected"] + damaged["left"] <= damaged["damaged"]
    assert damaged["fsck_found"] == damaged["left"]
    assert damaged["detected"] >= 1  # later turns promote what was damaged early


def test_a_full_root_fails_stores_cleanly_and_they_work_again(capsys):
    rc, result = _run(Chaos(fill_root_at=0.3, fill_for=0.3), seed=2)
    f = result.faults["fill_root"]
    assert "skipped" not in f, f  # tests run as root here: the tmpfs mounts
    _passed(rc, result)
    assert f["fills"] == 1 and f["filled_bytes"] > 0
    assert _check(result, "stores work after the root is freed").counts["written_after_free"] > 0
    assert "shmtier-stress" not in open("/proc/mounts").read()


def test_a_stalled_worker_does_not_stall_the_scheduler(capsys):
    rc, result = _run(Chaos(stall_at=(0.2,), stall_s=2.5), seed=3, turns=4)
    _passed(rc, result)
    f = result.faults["stall_worker"]
    assert f["stalls"] == 1 and f["resumed"] + f["killed_as_hung"] == 1
    check = _check(result, "calls bounded while a worker stalled")
    assert check.ok and check.counts["stall_max_call_ms"] < 500


def test_warm_restart_keeps_the_rows_byte_exact(capsys):
    for attempt in range(3):  # another suite's `shmtier clean` may take the stale segment
        rc, result = _run(Chaos(warm_restart_at=0.5), seed=4)
        if "skipped" not in result.faults["warm_restart"]:
            break
    _passed(rc, result)
    f = result.faults["warm_restart"]
    assert f["rows_kept"] > 0 and f["running"] == [] and f["old_slots_killed"] == 0
    assert _check(result, "warm restart: kept rows byte-exact").ok
    assert _check(result, "warm restart: old tier workers gone").ok
    out = capsys.readouterr().out
    assert "first scheduler (pid" in out and "SIGKILLed after request 12 of 24" in out


def test_files_too_big_for_a_chunk_are_never_served_and_all_removed(capsys):
    """Issue 28 item 4 under load: chunk files replaced by sparse 5 GiB files are MISSes
    the tier removes (or a fresh engine's listing does), never a failed listing or a
    failed promotion of their neighbours (the verdict's settling, index and fresh-scan
    checks fail then)."""
    rc, result = _run(Chaos(big_file_at=(0.3, 0.6), big_files=2), seed=6)
    _passed(rc, result)
    f = result.faults["big_files"]
    assert f["events"] == 2 and f["planted"] >= 2  # one file at least per event (how many
    # chunk files exist to replace at each event depends on the host's speed)
    check = _check(result, "files too big for a chunk removed")
    assert check.ok and check.counts["planted"] == f["planted"] and check.counts["left"] == 0
    assert check.counts["gone_in_run"] >= 1  # later turns promote what was replaced early


def test_a_namespace_link_with_a_worker_restarted_under_it_is_an_outage(capsys):
    """Issue 28 item 5 under load: the namespace directory moved aside and a symlink put
    in its place, a tier worker SIGKILLed meanwhile: its replacement starts (the pool broke
    for good: "failed to start 3 times"), and once the link is gone and the directory back
    cascades land again; no wrong byte, index equals files."""
    rc, result = _run(Chaos(namespace_link_at=(0.25,), link_for=0.25), seed=7, turns=5)
    _passed(rc, result)
    f = result.faults["namespace_link"]
    assert f["links"] == 1 and f["kills"] == 1 and f["replaced"] == 1 and f["pool_broken"] == 0
    assert f["put_back"] == 1
    assert _check(result, "tier workers start under a namespace link").ok
    assert _check(result, "stores work after the namespace link is removed").counts[
        "written_after_link"] > 0


def test_undoing_the_namespace_link_swaps_the_directory_back_in_one_step(tmp_path):
    """The operator's undo of the link: the directory, with its files and its inode,
    takes the link's place in one rename (no moment without a namespace, in which a
    tier worker's store would make one anew: "the directory put back 0x" in CI), and
    the link is gone."""
    from shmtier.stress import faults

    ns, aside = tmp_path / "root" / "ns", tmp_path / "aside"
    ns.mkdir(parents=True)
    (ns / "chunk.kv").write_bytes(b"x")
    inode = ns.stat().st_ino
    assert faults.link_namespace(str(ns), str(aside))
    assert ns.is_symlink() and aside.is_dir()
    assert faults.unlink_namespace(str(ns), str(aside))
    assert ns.is_dir() and not ns.is_symlink() and ns.stat().st_ino == inode
    assert (ns / "chunk.kv").read_bytes() == b"x" and not os.path.lexists(aside)


def test_a_wrong_byte_fails_the_verdict_with_its_step(capsys):
    victim = trace.chunk_keys(0, 1)[0]  # conversation 0's first chunk: loaded on later turns

    def expected(key: bytes):
        want = trace.content(key)
        if key == victim:
            want = want.copy()
            want[100] ^= 1
        return want

    rc, result = _run(Chaos(), seed=5, expected=expected, settle_each=True)
    assert rc == 1 and not result.passed
    assert not _check(result, "no wrong byte served").ok
    v = result.violations[0]
    assert v.check == "no wrong byte served" and "1 wrong bytes" in v.what
    assert v.what.startswith(f"chunk {victim.hex()[:16]}") and v.step > 0
    assert result.as_dict()["verdict"] == "FAIL"
    assert "all checks passed: NO: no wrong byte served" in capsys.readouterr().out


@pytest.mark.parametrize("bad, match", [
    (dict(corrupt_at=(1.5,)), r"Chaos.corrupt_at = \(1.5,\): fractions of the trace must be in \[0, 1\)"),
    (dict(fill_root_at=0.9, fill_for=0.2), r"Chaos.fill_for = 0.2: must be > 0 and end before"),
    (dict(corrupt_files=0), r"Chaos.corrupt_files = 0: must be >= 1"),
    (dict(big_files=0), r"Chaos.big_files = 0: must be >= 1"),
    (dict(namespace_link_at=(0.95,), link_for=0.1),
     r"Chaos.link_for = 0.1: must be > 0 and end before the trace does"),
    (dict(big_file_at=(-0.1,)), r"Chaos.big_file_at = \(-0.1,\): fractions of the trace"),
])
def test_bad_chaos_is_refused_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        Chaos(**bad)
