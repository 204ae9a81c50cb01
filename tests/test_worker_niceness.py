"""``tier_worker_niceness``, ``tier_worker_policy`` and ``tier_promotion_workers``:
validated with the other tiering keys, carried in the segment's pool config, and applied
by each real tier worker process (spawned by the scheduler, or started by ``shmtier
workers`` for an external pool): a background worker's niceness is the one it inherited
plus the configured value, its scheduling policy SCHED_BATCH unless the key says
"other"; a promotion worker (the last ``tier_promotion_workers``, default 1 of 2) keeps
the niceness it inherited and runs under SCHED_OTHER."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from fs_engine import END

from shmtier.config import ConfigError, KVLayout, TieringConfig
from shmtier.shared.pool_config import PoolConfig, WorkerPoolOptions
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


@pytest.mark.parametrize("niceness, policy, promotion", [(0, None, None), (7, "other", 0),
                                                         (3, "batch", 1), (5, None, 0)])
def test_spawned_workers_run_at_the_schedulers_niceness_plus_the_key(engine_id, tmp_path,
                                                                     niceness, policy, promotion):
    keys = {"tier_worker_niceness": niceness}
    if policy is not None:
        keys["tier_worker_policy"] = policy
    if promotion is not None:
        keys["tier_promotion_workers"] = promotion
    spec = TieringOffloadingSpec(_extra(tmp_path, **keys), LAYOUT, engine_id)
    assert spec.pool_config.options.tier_worker_niceness == niceness
    assert spec.pool_config.options.tier_promotion_workers == (1 if promotion is None else promotion)
    manager = spec.get_manager()
    try:
        pids = _beaten_worker_pids(spec)
        assert sorted(pids) == sorted(p.pid for p in spec.worker_pool._procs)  # the spawned ones
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        expected = os.SCHED_OTHER if policy == "other" else os.SCHED_BATCH  # batch: the default
        background = [(min(19, mine + niceness), expected)]
        if spec.pool_config.options.promotion_workers:  # worker 1: the engine's priority
            want = background + [(mine, os.SCHED_OTHER)]
        else:
            want = background * 2
        assert [(os.getpriority(os.PRIO_PROCESS, pid), os.sched_getscheduler(pid))
                for pid in pids] == want
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
        line = supervisor.stdout.readline()
        assert "2 tier workers" in line and "promotion lane: worker 1 at this process" in line
        pids = _beaten_worker_pids(spec)
        assert [_parent(pid) for pid in pids] == [supervisor.pid] * 2  # started by `shmtier workers`
        mine = os.getpriority(os.PRIO_PROCESS, 0)  # `shmtier workers` inherited it
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [min(19, mine + 7), mine]
        assert [os.sched_getscheduler(pid) for pid in pids] == [os.SCHED_BATCH, os.SCHED_OTHER]
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


def test_one_promotion_worker_by_default_when_there_are_two_or_more():
    assert TieringConfig.from_extra_config({}).pool.tier_promotion_workers == 1
    assert TieringConfig.from_extra_config(
        {"num_tier_workers": 1}).pool.tier_promotion_workers == 0
    assert TieringConfig.from_extra_config(
        {"num_tier_workers": 3}).pool.tier_promotion_workers == 1
    assert TieringConfig.from_extra_config(
        {"num_tier_workers": 3, "tier_promotion_workers": 2}).pool.tier_promotion_workers == 2
    assert TieringConfig.from_extra_config(
        {"tier_promotion_workers": None}).pool.tier_promotion_workers == 1  # null: absent
    assert PoolConfig(chunk_bytes=4096).options.promotion_workers == 1  # of the default 2
    assert WorkerPoolOptions(num_tier_workers=1).promotion_workers == 0
    assert WorkerPoolOptions(tier_promotion_workers=0).promotion_workers == 0  # as given


@pytest.mark.parametrize("workers, value", [(2, 2), (1, 1), (3, 3), (3, 7)])
def test_a_promotion_lane_without_a_background_worker_names_key_value_and_range(workers,
                                                                                value):
    with pytest.raises(ConfigError) as e:
        TieringConfig.from_extra_config({"num_tier_workers": workers,
                                         "tier_promotion_workers": value})
    assert (f"['tier_promotion_workers'] = {value!r} is invalid: expected an integer in "
            f"0..{workers - 1} (fewer than num_tier_workers = {workers}: at least one tier "
            f"worker stays in the background lane") in str(e.value)


@pytest.mark.parametrize("value", [-1, "one", 0.5, True])
def test_a_promotion_worker_count_that_is_no_count_names_key_value_and_range(value):
    with pytest.raises(ConfigError) as e:
        TieringConfig.from_extra_config({"num_tier_workers": 2, "tier_promotion_workers": value})
    assert f"['tier_promotion_workers'] = {value!r} is invalid: expected an integer >= 0" \
        in str(e.value)


def test_a_bad_promotion_worker_count_fails_the_spec_before_anything_is_created(engine_id,
                                                                                tmp_path):
    with pytest.raises(ConfigError, match=r"tier_promotion_workers'\] = 2 is invalid"):
        TieringOffloadingSpec(_extra(tmp_path, tier_promotion_workers=2), LAYOUT, engine_id)
    assert not [n for n in os.listdir("/dev/shm") if engine_id in n]
