"""The stress run's "stores work after the root is freed" check counts from the moment
stores can work: the free, or the fs root's return when the root was removed before
the free; when the root came back only as the trace ended it is not judged (nothing was
left to store). Real files under tmp_path; the chaos runner's own fault methods."""

from __future__ import annotations

import numpy as np

from shmtier.stress.chaos import WRITE_BYTES, Chaos, ChaosRunner


def _runner(tmp_path, counters):
    root = tmp_path / "root"
    root.mkdir()
    filler = tmp_path / "filler"
    chaos = Chaos(delete_root_at=(0.5,), root_gone_s=60.0, fill_root_at=0.6, fill_for=0.2)
    runner = ChaosRunner(chaos, np.random.default_rng(0), None, "no-engine", str(root), 10,
                         counters, None, filler=str(filler))
    return runner, root, filler


def _filled(runner, filler) -> None:
    filler.write_bytes(b"\0" * 4096)  # stands for faults.fill (no tmpfs needed here)
    runner.filled = True


def _freed_while_the_root_is_gone(tmp_path, counters):
    runner, root, filler = _runner(tmp_path, counters)
    runner._root()
    _filled(runner, filler)
    runner._free()
    assert not filler.exists() and runner.written_at_free is None  # root still gone
    return runner, root


def test_freed_while_the_root_is_gone_counts_from_its_return(tmp_path):
    counters = {WRITE_BYTES: 100}
    runner, root = _freed_while_the_root_is_gone(tmp_path, counters)
    counters[WRITE_BYTES] = 150  # (nothing can land while the root is gone)
    runner._recreate_root()
    assert root.is_dir() and runner.written_at_free == 150
    counters[WRITE_BYTES] = 190
    runner.stop()
    assert runner.counts["written_after_free"] == 40 and not runner.root_back_at_end


def test_a_root_back_only_at_the_end_is_not_judged(tmp_path):
    runner, root = _freed_while_the_root_is_gone(tmp_path, {WRITE_BYTES: 100})
    runner.stop()  # the trace ended before root_gone_s passed
    assert root.is_dir() and runner.root_back_at_end
    assert runner.written_at_free is None and runner.counts["written_after_free"] == 0


def test_freed_with_the_root_there_counts_from_the_free(tmp_path):
    counters = {WRITE_BYTES: 100}
    runner, root, filler = _runner(tmp_path, counters)
    _filled(runner, filler)
    runner._free()
    assert runner.written_at_free == 100
    counters[WRITE_BYTES] = 130
    runner.stop()
    assert runner.counts["written_after_free"] == 30 and not runner.root_back_at_end
