"""The stress run's namespace-link fault undoes the link only once the tier worker killed
under it has a healthy replacement, and the trace waits there for it: were the trace to
play on, a slow restart (a loaded host) could take the rest of the trace and leave nothing
to store after the link is gone, failing "stores work after the namespace link is
removed" for the harness's sake, not the tier's. A real engine: its shared-memory segment,
its tier-worker pool, an fs tier on real files under tmp_path."""

from __future__ import annotations

import os
import time

import numpy as np

from shmtier.stress.chaos import WRITE_BYTES, Chaos, ChaosRunner
from shmtier.stress.engine import Engine, shm_left
from shmtier.stress.invariants import Clock
from shmtier.stress.verdict import StressResult
from shmtier.tiers.fs.namespace import namespace_dir_name


def test_the_link_is_removed_only_after_the_killed_worker_was_replaced(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    engine_id = f"nslink-{os.getpid()}"
    extra = {"cpu_bytes_to_use": 16 << 16, "num_tier_workers": 2,
             "secondary_tiers": [{"type": "fs", "root_dir": str(root), "min_free_bytes": None}]}
    engine = Engine(extra, engine_id, 16, StressResult(), Clock())
    try:
        deadline = time.monotonic() + 60
        while len(engine.pool.healthy_workers()) < 2:  # both workers up and beating
            assert time.monotonic() < deadline, engine.pool.worker_states()
            engine.idle_step()
            time.sleep(0.01)
        namespace = namespace_dir_name(engine.spec.fingerprint)
        counters = {WRITE_BYTES: 7}
        runner = ChaosRunner(Chaos(namespace_link_at=(0.1,), link_for=0.1),
                             np.random.default_rng(0), engine.pool, engine_id, str(root), 10,
                             counters, None, namespace=namespace, idle_step=engine.idle_step)
        ns = root / namespace
        runner._link()  # the link in place, a healthy worker SIGKILLed under it
        killed = runner.linked[2]
        assert ns.is_symlink() and runner.counts["link_kills"] == 1 and killed is not None

        runner._unlink()  # link_for over at once: its replacement cannot have beaten yet

        assert runner.linked is None, "the link was left in place for the trace to go on"
        assert ns.is_dir() and not ns.is_symlink()
        assert runner.counts["link_replacements_healthy"] == 1
        assert runner.counts["namespace_dirs_put_back"] == 1
        slot, pid = killed
        assert any(s == slot and p != pid for s, p in engine.pool.healthy_workers())
        assert engine.pool.broken is None
        counters[WRITE_BYTES] = 19
        runner.stop()
        assert runner.counts["written_after_link"] == 12 and not runner.link_removed_at_end
    finally:
        engine.close()
    assert shm_left(engine_id) == []
