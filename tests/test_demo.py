"""``shmtier demo`` (what ``scripts/run`` runs) works end to end and cleans up."""

from __future__ import annotations

from shmtier.cli import main


def test_demo_round_trips_bytes_and_reports(capsys):
    assert main(["demo", "--requests", "6", "--chunks-per-request", "6", "--cpu-mib", "4"]) == 0
    out = capsys.readouterr().out
    assert "loaded bytes identical to the offloaded GPU blocks: yes" in out
    assert "segment removed on shutdown: yes" in out
    assert "prefix hits" in out and "evicted" in out


def test_segments_and_clean_commands(capsys):
    assert main(["segments"]) == 0
    assert main(["clean"]) == 0


def test_stress_run_promotes_from_fs_byte_exactly(capsys):
    assert main(["run", "--conversations", "6", "--turns", "3", "--cpu-chunks", "12",
                 "--settle-each"]) == 0
    out = capsys.readouterr().out
    assert "loaded chunks identical to what was offloaded: yes" in out
    assert "segment and ring semaphores removed on shutdown: yes" in out
    promoted = int(out.split("  fs tier")[1].split()[0])
    assert promoted > 0
