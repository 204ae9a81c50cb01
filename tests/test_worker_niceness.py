"""``tier_worker_niceness`` and ``tier_worker_policy``: validated with the other tiering
keys, carried in the segment's pool config, and applied by each real tier worker process
(spawned by the scheduler, or started by ``shmtier workers`` for an external pool): its
niceness is the one it inherited plus the configured value, its scheduling policy
SCHED_BATCH unless the key says "other"."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from fs_engine import END

from shmtier.config import ConfigError, KVLayout, TieringConfig
from shmtier.shared.pool_config import PoolConfig
from shmtier.spec import TieringOffloadingSpec

LAYOUT = KVLayout("m", "bfloat16", 16, 8192, 1)


def _extra(root, **keys) -> dict:
    return {"cpu_bytes_to_use": 8 * 8192, "num_tier_workers": 2,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root), "min_free_bytes": None}],
            **keys}


def _beaten_worker_pids(spec, timeout_s: float = 20.0) -> list[int]:
    """Pids in the two worker slots' heartbeats once both have beaten (a worker beats
    after it set its niceness), stepping the scheduler meanwhile."""
    manager, rings = spec.get_manager(), spec.worker_pool.rings
    deadline = time.monotonic() + timeout_s
    while True:
        with manager.lock:
            manager.on_schedule_end(END)
        pids = [rings.worker(i).last_beat().pid for i in range(2)]
        if all(pids) and all(rings.worker(i).holder_alive() for i in range(2)):
            return pids
        assert time.monotonic() < deadline, f"tier workers did not beat: slot pids {pids}"
        time.sleep(0.02)


def _parent(pid: int) -> int:
    """``pid``'s parent pid (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("niceness, policy", [(0, None), (7, "other"), (3, "batch")])
def test_spawned_workers_run_at_the_schedulers_niceness_plus_the_key(engine_id, tmp_path,
                                                                     niceness, policy):
    keys = {"tier_worker_niceness": niceness}
    if policy is not None:
        keys["tier_worker_policy"] = policy
    spec = TieringOffloadingSpec(_extra(tmp_path, **keys), LAYOUT, engine_id)
    assert spec.pool_config.options.tier_worker_niceness == niceness
    manager = spec.get_manager()
    try:
        pids = _beaten_worker_pids(spec)
        assert sorted(pids) == sorted(p.pid for p in spec.worker_pool._procs)  # the spawned ones
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [mine + niceness] * 2
        expected = os.SCHED_OTHER if policy == "other" else os.SCHED_BATCH  # batch: the default
        assert [os.sched_getscheduler(pid) for pid in pids] == [expected] * 2
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the scheduler process keeps its own
    finally:
        manager.shutdown()


def test_external_workers_apply_the_engines_niceness(engine_id, tmp_path):
    """``shmtier workers`` reads the key from the segment, not from its own arguments."""
    spec = TieringOffloadingSpec(_extra(tmp_path, workers="external", tier_worker_niceness=7),
                                 LAYOUT, engine_id)
    manager = spec.get_manager()
    supervisor = None
    try:
        supervisor = subprocess.Popen([sys.executable, "-m", "shmtier", "workers", "--engine-id",
                                       engine_id], stdout=subprocess.PIPE, text=True)
        assert "2 tier workers" in supervisor.stdout.readline()
        pids = _beaten_worker_pids(spec)
        assert [_parent(pid) for pid in pids] == [supervisor.pid] * 2  # started by `shmtier workers`
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [mine + 7] * 2
        assert [os.sched_getscheduler(pid) for pid in pids] == [os.SCHED_BATCH] * 2
    finally:
        if supervisor is not None:
            supervisor.terminate()
            supervisor.wait(10)
            supervisor.stdout.close()
        manager.shutdown()


def test_default_is_ten():
    assert TieringConfig.from_extra_config({}).pool.tier_worker_niceness == 10
    assert PoolConfig(chunk_bytes=4096).options.tier_worker_niceness == 10
    assert TieringConfig.from_extra_config(
        {"tier_worker_niceness": 19}).pool.tier_worker_niceness == 19


def test_policy_default_is_batch_and_a_bad_one_names_the_choices():
    assert TieringConfig.from_extra_config({}).pool.tier_worker_policy == "batch"
    assert PoolConfig(chunk_bytes=4096).options.tier_worker_policy == "batch"
    with pytest.raises(ConfigError, match=r"\['tier_worker_policy'\] = 'idle' is invalid: "
                                          r"expected one of 'batch', 'other'"):
        TieringConfig.from_extra_config({"tier_worker_policy": "idle"})


@pytest.mark.parametrize("value", [-1, 20, "x", True, 2.5])
def test_a_bad_niceness_is_a_config_error_naming_key_value_and_range(value):
    with pytest.raises(ConfigError) as e:
        TieringConfig.from_extra_config({"tier_worker_niceness": value})
    text = str(e.value)
    assert "['tier_worker_niceness']" in text
    assert f"= {value!r} is invalid" in text
    assert "an integer in 0..19" in text


def test_a_bad_niceness_fails_the_spec_before_anything_is_created(engine_id, tmp_path):
    with pytest.raises(ConfigError, match=r"tier_worker_niceness'\] = 20 is invalid"):
        TieringOffloadingSpec(_extra(tmp_path, tier_worker_niceness=20), LAYOUT, engine_id)
    assert not [n for n in os.listdir("/dev/shm") if engine_id in n]
