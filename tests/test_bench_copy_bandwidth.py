"""bench/copy_bandwidth.py (the block copy worker against a plain copy) runs on CPU tensors:
its figures print, every repeat's loaded bytes are checked against the stored ones, and
its segment is gone afterwards (the session's leak check)."""

from __future__ import annotations

from bench import copy_bandwidth


def test_copy_bandwidth_runs_on_cpu(capsys):
    assert copy_bandwidth.main(["--device", "cpu", "--chunks", "8", "--blocks-per-chunk", "2",
                                "--page-kib", "4", "--job-chunks", "3", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("shmtier store", "shmtier load", "plain d2h", "plain h2d"):
        assert name in out and "GB/s" in out
    assert "loaded bytes equal the stored ones" in out
