"""``shmtier demo`` (what ``scripts/run`` runs) works end to end and cleans up."""

from __future__ import annotations

from shmtier.cli import main


def test_demo_round_trips_bytes_and_reports(capsys):
    assert main(["demo", "--requests", "6", "--chunks-per-request", "6", "--cpu-mib", "4"]) == 0
    out = capsys.readouterr().out
    assert "loaded bytes identical to the offloaded GPU blocks: yes" in out
    assert "segment removed on shutdown: yes" in out
    assert "prefix hits" in out and "evicted" in out


def test_segments_and_clean_commands(capsys, engine_id):
    assert main(["segments"]) == 0
    capsys.readouterr()
    # only this test's engine: a bare `shmtier clean` would take every stale segment on
    # the host, among them those other suites keep for a warm restart
    assert main(["clean", engine_id]) == 0
    assert capsys.readouterr().out.strip() == "nothing stale"


def test_stress_run_promotes_from_fs_byte_exactly(capsys):
    assert main(["run", "--conversations", "6", "--turns", "3", "--cpu-chunks", "12",
                 "--settle-each"]) == 0
    out = capsys.readouterr().out
    assert "loaded chunks identical to what was offloaded: yes" in out
    assert "segment and ring semaphores removed on shutdown: yes" in out
    promoted = int(out.split("  fs tier")[1].split()[0])
    assert promoted > 0


def test_stress_run_under_chaos_keeps_bytes_and_index_exact(capsys):
    """Issue 11's acceptance run, short: tier workers SIGKILLed every ~0.6 s, the
    namespace removed, then the root itself removed and made again, under max_bytes.
    No wrong byte; the fs gauge equals the *.kv bytes; no orphan either way, live and
    after a fresh engine's start-up scan of the same root."""
    assert main(["run", "--conversations", "32", "--turns", "8", "--seed", "3",
                 "--kill-workers-every", "0.6", "--delete-namespace-at", "0.35",
                 "--delete-root-at", "0.7", "--root-gone-s", "0.5",
                 "--max-bytes", "24000000"]) == 0
    out = capsys.readouterr().out
    kills = int(out.split("chaos: ")[1].split()[0])
    assert kills >= 2
    assert "namespace deleted 1x, root deleted and recreated 1x" in out
    resets = int(out.split("fs tier: ")[1].split()[0])
    assert resets >= 1
    assert "[FAIL]" not in out
    for who in ("live engine", "fresh engine"):
        assert f"[ok] {who}: orphan files (on disk, not indexed): 0 " in out
        assert f"[ok] {who}: indexed chunks without a file: 0; size differs: 0" in out
        line = next(x for x in out.splitlines() if f"{who}: fs bytes_on_disk gauge" in x)
        assert line.startswith("  [ok]") and line.endswith("diff +0")
    assert "[ok] wrong bytes served: 0 in " in out
    assert "all checks passed: yes" in out
