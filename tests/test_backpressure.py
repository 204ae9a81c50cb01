"""Backpressure detector, policies and configuration (docs/vllm-contract.md §8, docs/design.md §4/§6).

Every time-dependent test runs on a fake clock: nothing sleeps. The last part
drives vLLM 0.33's own detector and policies side by side with ours (hypothesis)
and requires identical decisions, pressure flags and EMA values.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import pickle
import random
import re
import subprocess
import sys
import types
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtier.metrics import CounterMetadata, GaugeMetadata, OffloadingStats
from shmtier.scheduler import backpressure as bp
from shmtier.scheduler.backpressure import (
    BackpressureConfigError,
    BackpressureDetector,
    BackpressureSettings,
    DropAccountingPolicy,
    DropStorePolicy,
    EMABackpressureDetector,
    ThrottledDropPolicy,
    build_detector,
    build_detector_from_config,
)

MIB = 1 << 20
HIGH, LOW = 0.25, 0.0625  # powers of two: ramp arithmetic is exact


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make(policy=None, **kw) -> tuple[EMABackpressureDetector, FakeClock]:
    clock = FakeClock()
    params = dict(high_water_s=HIGH, low_water_s=LOW, warmup_completions=1,
                  decay_half_life_s=2.0, cooldown_s=1.0)
    params.update(kw)
    return EMABackpressureDetector(policy=policy, clock=clock, **params), clock


def complete(det: EMABackpressureDetector, s_per_mib: float, mib: float = 1.0) -> None:
    """A successful store whose latency is ``s_per_mib`` per MiB."""
    det.on_store_completed(s_per_mib * mib, int(mib * MIB))


def pressured(policy=None, ema: float | None = None, **kw):
    """A warmed-up detector under pressure, EMA set to ``ema`` (clock frozen)."""
    det, clock = make(policy, alpha=1.0, **kw)
    complete(det, LOW)  # seeds the EMA (warmup 1)
    complete(det, 4 * HIGH)
    assert det.is_under_pressure()
    if ema is not None:
        det.store_latency_ema = ema
    return det, clock


# ================================================================== EMA detector


def test_warmup_seeds_the_mean_at_exactly_n_completions():
    det, _ = make(warmup_completions=4, alpha=0.5)
    for i, x in enumerate([1.0, 2.0, 3.0]):
        complete(det, x)  # far above high water: still no decision during warmup
        assert det.store_latency_ema == 0.0
        assert not det.is_under_pressure()
        assert not det.warmed_up
    complete(det, 6.0)
    assert det.store_latency_ema == pytest.approx(3.0)  # mean of 1, 2, 3, 6
    assert det.warmed_up
    # seeding alone decides nothing; the next completion does
    assert not det.is_under_pressure()
    complete(det, 1.0)
    assert det.store_latency_ema == pytest.approx(0.5 * 1.0 + 0.5 * 3.0)
    assert det.is_under_pressure()


def test_sample_is_seconds_per_mib_and_ema_update():
    det, _ = make(alpha=0.15, warmup_completions=1)
    det.on_store_completed(0.2, 4 * MIB)  # 0.05 s/MiB
    assert det.store_latency_ema == pytest.approx(0.05)
    det.on_store_completed(0.05, MIB // 2)  # 0.1 s/MiB
    assert det.store_latency_ema == pytest.approx(0.15 * 0.1 + 0.85 * 0.05)
    assert det.stats == {"store_latency_ema": det.store_latency_ema,
                         "consecutive_store_failures": 0}


def test_update_measures_elapsed_on_the_detector_clock():
    det, clock = make(warmup_completions=1)
    submit = clock()
    clock.advance(0.5)
    det.update(submit, 2 * MIB)
    assert det.store_latency_ema == pytest.approx(0.25)
    det.update(clock(), 0)  # no bytes: ignored
    det.update(clock(), -5)
    det.on_store_completed(1.0, 0)  # no division by zero either
    assert det.store_latency_ema == pytest.approx(0.25)
    det2, clock2 = make(warmup_completions=1)
    det2.update(clock2() + 10, MIB)  # submit time in the future: counts as 0 s
    assert det2.store_latency_ema == 0.0


def test_activation_hysteresis_and_clearing():
    det, _ = make(alpha=1.0)
    complete(det, LOW)  # seed
    complete(det, HIGH)  # == high: not above
    assert not det.is_under_pressure()
    complete(det, HIGH * 1.01)
    assert det.is_under_pressure()
    complete(det, (LOW + HIGH) / 2)  # band keeps pressure
    assert det.is_under_pressure()
    complete(det, LOW)  # == low: not below, still kept
    assert det.is_under_pressure()
    complete(det, LOW * 0.99)
    assert not det.is_under_pressure()
    complete(det, (LOW + HIGH) / 2)  # band keeps "no pressure" too
    assert not det.is_under_pressure()


def test_idle_decay_clears_pressure_after_enough_half_lives():
    det, clock = pressured(ema=4 * HIGH, decay_half_life_s=2.0, cooldown_s=0.0)
    # 4*HIGH = 16*LOW: below LOW needs more than 4 half-lives (8 s)
    clock.advance(7.9)
    assert det.is_under_pressure()
    assert det.store_latency_ema == pytest.approx(4 * HIGH * 0.5 ** (7.9 / 2))
    clock.advance(0.2)  # 8.1 s in total, decay compounds from the last check
    assert not det.is_under_pressure()
    assert det.store_latency_ema == pytest.approx(4 * HIGH * 0.5 ** (8.1 / 2))
    ema = det.store_latency_ema
    clock.advance(100)  # no decay without pressure
    assert not det.is_under_pressure()
    assert det.store_latency_ema == ema


def test_zero_half_life_disables_decay():
    det, clock = pressured(ema=4 * HIGH, decay_half_life_s=0.0)
    clock.advance(1e6)
    assert det.is_under_pressure()
    assert det.store_latency_ema == 4 * HIGH


def test_cooldown_drops_every_second_call():
    det, clock = pressured(DropStorePolicy(), cooldown_s=1.0)
    complete(det, LOW / 2)  # clears: cooldown starts now
    assert not det.is_under_pressure()
    assert det.in_cooldown
    decisions = [det.should_store(3) for _ in range(6)]
    assert decisions == [True, False] * 3
    assert det.policy.pop_stores_dropped() == (3, 9)
    clock.advance(1.0)  # cooldown over
    assert not det.in_cooldown
    assert [det.should_store(3) for _ in range(4)] == [True] * 4
    assert det.policy.pop_stores_dropped() == (0, 0)


def test_cooldown_after_idle_decay_clears():
    det, clock = pressured(DropStorePolicy(), ema=2 * HIGH, cooldown_s=1.0)
    clock.advance(10.0)
    assert [det.should_store(1) for _ in range(4)] == [True, False, True, False]


def test_pressure_cancels_cooldown():
    det, _ = pressured(DropStorePolicy())
    complete(det, 0.0)
    assert det.in_cooldown
    complete(det, 8 * HIGH)
    assert det.is_under_pressure() and not det.in_cooldown
    assert not det.should_store(1)


def test_healthy_fast_path_bypasses_cooldown():
    det, _ = pressured(DropStorePolicy(), cooldown_s=100.0)
    for _ in range(9):
        complete(det, 0.0)
    assert not det.is_healthy()
    assert [det.should_store(1) for _ in range(2)] == [True, False]
    complete(det, 0.0)  # 10th consecutive completion below low water
    assert det.is_healthy()
    assert all(det.should_store(1) for _ in range(5))
    complete(det, (LOW + HIGH) / 2)  # band resets the streak
    assert not det.is_healthy()


@pytest.mark.parametrize("ramp, ema_factor, pattern", [
    (2.0, 1.0, [True] * 8),  # at high water: 0 %
    (2.0, 1.5, [True, True, True, False] * 2),  # 25 %
    (2.0, 2.0, [True, False] * 4),  # 50 %
    (2.0, 2.5, [True, False, False, False] * 2),  # 75 %: accumulator .75 1.5 2.25 3.0
    (2.0, 3.0, [False] * 8),  # 100 %
    (2.0, 9.0, [False] * 8),
    (3.0, 2.5, [True, False] * 4),  # ramp 3: 50 % at 2.5 x high
    (3.0, 4.0, [False] * 8),
])
def test_throttled_ramp(ramp, ema_factor, pattern):
    det, _ = pressured(ThrottledDropPolicy(ramp_factor=ramp), ema=ema_factor * HIGH)
    assert [det.should_store(2) for _ in pattern] == pattern
    dropped = pattern.count(False)
    assert det.policy.pop_stores_dropped() == (dropped, 2 * dropped)


def test_throttled_band_drops_nothing_and_drop_store_drops_all():
    det, _ = pressured(ThrottledDropPolicy(), ema=(LOW + HIGH) / 2)
    assert det.is_under_pressure()
    assert all(det.should_store(1) for _ in range(10))
    det2, _ = pressured(DropStorePolicy(), ema=(LOW + HIGH) / 2)
    assert not any(det2.should_store(1) for _ in range(10))
    assert det2.policy.pop_stores_dropped() == (10, 10)


def test_throttled_accumulator_resets():
    det, _ = pressured(ThrottledDropPolicy(), ema=1.5 * HIGH)
    assert [det.should_store(1) for _ in range(3)] == [True] * 3
    det.policy.reset()
    assert [det.should_store(1) for _ in range(4)] == [True, True, True, False]


def test_throttled_needs_the_ema_detector():
    class Plain(BackpressureDetector):
        def on_store_completed(self, elapsed_s, nbytes): ...
        def is_under_pressure(self): return True
        def reset(self): ...

    with pytest.raises(TypeError, match="EMABackpressureDetector"):
        Plain().should_store(1)
    with pytest.raises(ValueError, match="ramp_factor"):
        ThrottledDropPolicy(ramp_factor=0)


def test_default_policy_is_throttled():
    det, _ = make()
    assert isinstance(det.policy, ThrottledDropPolicy)
    assert det.policy.ramp_factor == 2.0


def test_failure_threshold_trips_during_warmup_and_resets_on_success():
    det, clock = make(failure_threshold=3, warmup_completions=10)
    det.on_store_failed()
    det.on_store_failed()
    assert not det.is_under_pressure()
    complete(det, 0.0)  # success resets the streak
    assert det.stats["consecutive_store_failures"] == 0
    det.on_store_failed()
    det.on_store_failed()
    assert not det.is_under_pressure()
    det.on_store_failed()
    assert det.stats["consecutive_store_failures"] == 3
    assert det.is_under_pressure()  # during warmup
    assert det.store_latency_ema == 4 * HIGH
    assert not det.should_store(5)  # 4 x high: throttled drops everything
    # idle decay applies during warmup when failure-tripped: 16x low needs > 4 half-lives
    clock.advance(8.5)
    assert not det.is_under_pressure()
    det.on_store_failed()  # the probe fails: re-enters pressure at once
    assert det.is_under_pressure()


def test_failure_trip_keeps_a_higher_ema_and_ignores_without_threshold():
    det, _ = pressured(failure_threshold=1, ema=10 * HIGH)
    det.on_store_failed()
    assert det.store_latency_ema == 10 * HIGH
    det2, _ = make(warmup_completions=0)
    for _ in range(100):
        det2.on_store_failed()
    assert not det2.is_under_pressure()
    assert det2.stats["consecutive_store_failures"] == 0


def test_failure_trip_cleared_by_fast_completion():
    det, _ = make(failure_threshold=2, warmup_completions=1, alpha=1.0)
    complete(det, 0.0)
    det.on_store_failed()
    det.on_store_failed()
    assert det.is_under_pressure()
    complete(det, 0.0)
    assert not det.is_under_pressure()


def test_reset_clears_everything():
    det, clock = pressured(DropStorePolicy(), failure_threshold=1)
    det.should_store(4)
    det.note_ring_full()
    det.reset()
    assert not det.is_under_pressure()
    assert det.store_latency_ema == 0.0
    assert not det.warmed_up
    assert not det.ring_full_pending
    assert det.policy.pop_stores_dropped() == (0, 0)
    assert det.stats == {"store_latency_ema": 0.0, "consecutive_store_failures": 0}


# ============================================================== drop accounting


def test_drop_accounting_pop_and_reset():
    policy = DropStorePolicy()
    assert isinstance(policy, DropAccountingPolicy)
    policy.on_store_skipped(3)
    policy.on_store_skipped(5)
    assert policy.pop_stores_dropped() == (2, 8)
    assert policy.pop_stores_dropped() == (0, 0)
    policy.on_store_skipped(1)
    policy.reset()
    assert policy.pop_stores_dropped() == (0, 0)


# ================================================================ ring-full signal


def test_ring_full_drops_the_next_decision_only():
    det, _ = make(policy=DropStorePolicy())
    assert det.should_store(2)
    det.note_ring_full()
    det.note_ring_full()  # several notes, still one decision
    assert det.ring_full_pending
    assert not det.should_store(7)
    assert not det.ring_full_pending
    assert det.should_store(2)
    assert det.policy.pop_stores_dropped() == (1, 7)
    assert not det.is_under_pressure()  # latency state untouched
    assert det.store_latency_ema == 0.0


def test_ring_full_counts_the_rejected_job_and_overrides_healthy():
    det, _ = make(policy=DropStorePolicy(), alpha=1.0)
    for _ in range(12):
        complete(det, 0.0)
    assert det.is_healthy()
    det.note_ring_full(dropped_blocks=4)
    assert det.policy.pop_stores_dropped() == (1, 4)
    assert not det.should_store(3)
    assert det.should_store(3)
    assert det.policy.pop_stores_dropped() == (1, 3)
    assert det.is_healthy()


def test_ring_full_does_not_disturb_cooldown_or_decay():
    det, clock = pressured(DropStorePolicy(), ema=2 * HIGH)
    clock.advance(10.0)
    det.note_ring_full()
    assert not det.should_store(1)  # ring full; pressure cleared by decay meanwhile
    assert not det.is_under_pressure()
    assert det.in_cooldown
    assert [det.should_store(1) for _ in range(4)] == [True, False, True, False]


def test_ring_full_in_base_detector():
    class Never(BackpressureDetector):
        def on_store_completed(self, elapsed_s, nbytes): ...
        def is_under_pressure(self): return False
        def reset(self): self._policy.reset()

    det = Never(DropStorePolicy())
    det.note_ring_full()
    assert [det.should_store(2), det.should_store(2)] == [False, True]
    assert det.policy.pop_stores_dropped() == (1, 2)


# ================================================================== configuration

W = "secondary_tiers[0].backpressure"


def params(det: EMABackpressureDetector) -> dict:
    return {k: getattr(det, k) for k in ("high_water_s", "low_water_s", "alpha",
                                         "warmup_completions", "decay_half_life_s",
                                         "cooldown_s", "failure_threshold")}


def test_no_config_no_detector():
    assert build_detector_from_config("fs", None, None, None) is None
    assert build_detector_from_config("fs", None, {"alpha": 0.5}, False) is None  # tier opts out
    # locality is not ours then
    assert build_detector_from_config("fs", "bogus", None, None) is None


def test_bare_dict_gives_the_ema_detector_with_defaults():
    for top, tier in (({}, None), (None, {}), ({}, {}), (False, {})):
        det = build_detector_from_config("fs", None, top, tier, where=W)
        assert type(det) is EMABackpressureDetector
        assert isinstance(det.policy, ThrottledDropPolicy)
        assert params(det) == dict(high_water_s=0.010, low_water_s=0.002, alpha=0.15,
                                   warmup_completions=10, decay_half_life_s=2.0,
                                   cooldown_s=1.0, failure_threshold=3)


@pytest.mark.parametrize("tier_type, locality, high, low, threshold", [
    ("fs", None, 0.010, 0.002, 3),
    ("fs", "LOCAL", 0.010, 0.002, 3),
    ("fs", "REMOTE", 0.050, 0.010, 3),
    ("fs", "remote", 0.050, 0.010, 3),
    ("obj", None, 0.050, 0.010, 3),
    ("obj", "LOCAL", 0.050, 0.010, 3),
    ("example", None, 0.010, 0.002, None),
    ("p2p", "REMOTE", 0.050, 0.010, None),
    ("my_tier", None, 0.010, 0.002, None),
])
def test_defaults_by_type_and_locality(tier_type, locality, high, low, threshold):
    det = build_detector_from_config(tier_type, locality, None, {}, where=W)
    assert (det.high_water_s, det.low_water_s, det.failure_threshold) == (high, low, threshold)
    assert EMABackpressureDetector.default_config(tier_type, locality=locality) == {
        "high_water_s": high, "low_water_s": low,
        **({"failure_threshold": threshold} if threshold else {})}


def test_user_keys_win_over_defaults():
    det = build_detector_from_config("obj", None, None,
                                     {"high_water_s": 0.2, "failure_threshold": None}, where=W)
    assert det.high_water_s == 0.2
    assert det.low_water_s == 0.010  # default still fills the gap
    assert det.failure_threshold is None  # explicit null turns failures off


def test_field_by_field_merge():
    top = {"alpha": 0.5, "cooldown_s": 3.0, "policy_cls": "DropStorePolicy",
           "high_water_s": 0.1}
    tier = {"cooldown_s": 0.5, "low_water_s": 0.05}
    det = build_detector_from_config("fs", None, top, tier, where=W)
    assert params(det) == dict(high_water_s=0.1, low_water_s=0.05, alpha=0.5,
                               warmup_completions=10, decay_half_life_s=2.0,
                               cooldown_s=0.5, failure_threshold=3)
    assert type(det.policy) is DropStorePolicy
    assert top == {"alpha": 0.5, "cooldown_s": 3.0, "policy_cls": "DropStorePolicy",
                   "high_water_s": 0.1}  # inputs untouched
    assert tier == {"cooldown_s": 0.5, "low_water_s": 0.05}
    # the top level alone applies to every tier
    det = build_detector_from_config("example", None, top, None, where=W)
    assert det.alpha == 0.5 and det.failure_threshold is None


def test_policy_parameters():
    det = build_detector_from_config("fs", None, None, {
        "policy_cls": "ThrottledDropPolicy", "policy_kwargs": {"ramp_factor": 3.0}})
    assert det.policy.ramp_factor == 3.0
    det = build_detector_from_config("fs", None, {"policy_kwargs": {"ramp_factor": 4}}, {})
    assert type(det.policy) is ThrottledDropPolicy and det.policy.ramp_factor == 4.0
    # policy_kwargs is one field: the tier's replaces the top level's whole
    det = build_detector_from_config("fs", None, {"policy_kwargs": {"ramp_factor": 4}},
                                     {"policy_kwargs": {}})
    assert det.policy.ramp_factor == 2.0
    det = build_detector_from_config("fs", None, None, {"policy_cls": "DropStorePolicy",
                                                        "policy_kwargs": {}})
    assert type(det.policy) is DropStorePolicy


def test_dotted_names_and_classes(monkeypatch):
    class MyPolicy(DropAccountingPolicy):
        def __init__(self, every: int = 2):
            super().__init__()
            self.every = every

        def should_store(self, detector):
            return True

    class MyDetector(BackpressureDetector):
        def __init__(self, threshold, policy=None, *, clock):
            super().__init__(policy or MyPolicy(), clock=clock)
            self.threshold = threshold

        def on_store_completed(self, elapsed_s, nbytes): ...
        def is_under_pressure(self): return False
        def reset(self): ...

    module = types.ModuleType("bp_plugin_for_tests")
    module.MyPolicy, module.MyDetector = MyPolicy, MyDetector
    monkeypatch.setitem(sys.modules, "bp_plugin_for_tests", module)
    clock = FakeClock()
    det = build_detector_from_config("fs", None, None, {
        "backpressure_cls": "bp_plugin_for_tests.MyDetector", "threshold": 7,
        "policy_cls": "bp_plugin_for_tests.MyPolicy", "policy_kwargs": {"every": 3}},
        clock=clock)
    assert type(det) is MyDetector and det.threshold == 7 and det.clock is clock
    assert type(det.policy) is MyPolicy and det.policy.every == 3
    det = build_detector_from_config("fs", None, None,
                                     {"backpressure_cls": MyDetector, "threshold": 1})
    assert type(det.policy) is MyPolicy
    det = build_detector_from_config("fs", None, None, {
        "backpressure_cls": "shmtier.scheduler.backpressure.EMABackpressureDetector",
        "policy_cls": "shmtier.scheduler.backpressure.DropStorePolicy"}, clock=clock)
    assert type(det) is EMABackpressureDetector and type(det.policy) is DropStorePolicy
    assert det.clock is clock
    with pytest.raises(BackpressureConfigError,
                       match=r"backpressure\.threshold = 'x'|needs 'threshold'"):
        build_detector_from_config("fs", None, None, {"backpressure_cls": MyDetector}, where=W)
    with pytest.raises(BackpressureConfigError, match="ThrottledDropPolicy needs backpressure_cls"):
        build_detector_from_config("fs", None, None, {
            "backpressure_cls": MyDetector, "threshold": 1, "policy_cls": "ThrottledDropPolicy"})


def _error(top, tier, tier_type="fs", locality=None) -> str:
    with pytest.raises(BackpressureConfigError) as info:
        build_detector_from_config(tier_type, locality, top, tier, where=W)
    assert isinstance(info.value, ValueError)
    return str(info.value)


@pytest.mark.parametrize("tier, expected", [
    ({"backpressure_cls": "Nope"}, [f"{W}.backpressure_cls = 'Nope'",
                                    "'EMABackpressureDetector'"]),
    ({"backpressure_cls": "EMABackpressureDetektor"}, ["did you mean 'EMABackpressureDetector'"]),
    ({"backpressure_cls": "no_such_module_xyz.Det"}, ["'no_such_module_xyz.Det'",
                                                      "cannot be imported", "expected"]),
    ({"backpressure_cls": "shmtier.scheduler.backpressure.Nope"}, ["has no attribute 'Nope'"]),
    ({"backpressure_cls": "shmtier.scheduler.backpressure.DropStorePolicy"},
     ["is not a detector class"]),
    ({"backpressure_cls": "BackpressureDetector"}, ["'BackpressureDetector' is invalid"]),
    ({"backpressure_cls": 3}, [f"{W}.backpressure_cls = 3", "expected"]),
    ({"policy_cls": "DropPolicy"}, [f"{W}.policy_cls = 'DropPolicy'", "'DropStorePolicy'",
                                    "'ThrottledDropPolicy'"]),
    ({"policy_cls": "shmtier.scheduler.backpressure.EMABackpressureDetector"},
     ["is not a policy class"]),
    ({"policy_kwargs": [1]}, [f"{W}.policy_kwargs = [1]", "expected a mapping"]),
    ({"policy_kwargs": {"ramp": 3}}, [f"{W}.policy_kwargs.ramp = 3", "unknown key",
                                      "['ramp_factor']"]),
    ({"policy_kwargs": {"ramp_factor": 0}}, [f"{W}.policy_kwargs.ramp_factor = 0",
                                             "a finite number > 0"]),
    ({"policy_kwargs": {"ramp_factor": "2"}}, ["ramp_factor = '2'", "number"]),
    ({"policy_cls": "DropStorePolicy", "policy_kwargs": {"ramp_factor": 2}},
     [f"{W}.policy_kwargs.ramp_factor = 2", "unknown key for DropStorePolicy",
      "accepted keys: []"]),
    ({"high_water_s": 0.001}, [f"{W}.low_water_s (default for tier type 'fs') = 0.002",
                               f"<= {W}.high_water_s = 0.001"]),
    ({"high_water_s": 0.01, "low_water_s": 0.02}, [f"{W}.low_water_s = 0.02",
                                                   f"{W}.high_water_s = 0.01"]),
    ({"high_water_s": -1}, [f"{W}.high_water_s = -1", "a finite number > 0"]),
    ({"high_water_s": 0}, [f"{W}.high_water_s = 0", "> 0"]),
    ({"high_water_s": math.inf}, [f"{W}.high_water_s = inf", "finite"]),
    ({"high_water_s": "0.1"}, [f"{W}.high_water_s = '0.1'", "number"]),
    ({"low_water_s": -0.5}, [f"{W}.low_water_s = -0.5", "> 0"]),
    ({"alpha": 0}, [f"{W}.alpha = 0", "(0, 1]"]),
    ({"alpha": 1.5}, [f"{W}.alpha = 1.5", "(0, 1]"]),
    ({"alpha": True}, [f"{W}.alpha = True", "(0, 1]"]),
    ({"alpha": math.nan}, [f"{W}.alpha = nan"]),
    ({"warmup_completions": -1}, [f"{W}.warmup_completions = -1", "an integer >= 0"]),
    ({"warmup_completions": 2.5}, [f"{W}.warmup_completions = 2.5", "an integer"]),
    ({"warmup_completions": "10"}, [f"{W}.warmup_completions = '10'", "an integer"]),
    ({"decay_half_life_s": -2}, [f"{W}.decay_half_life_s = -2", ">= 0"]),
    ({"cooldown_s": -0.1}, [f"{W}.cooldown_s = -0.1", ">= 0"]),
    ({"cooldown_s": None}, [f"{W}.cooldown_s = None", ">= 0"]),
    ({"failure_threshold": 0}, [f"{W}.failure_threshold = 0", "an integer >= 1",
                                "null"]),
    ({"failure_threshold": 1.5}, [f"{W}.failure_threshold = 1.5"]),
    ({"high_water": 0.1}, [f"{W}.high_water = 0.1", "unknown key",
                           "did you mean 'high_water_s'", "'backpressure_cls'"]),
    ({"ramp_factor": 3.0}, [f"{W}.ramp_factor = 3.0", "unknown key", "'policy_kwargs'"]),
    ({"policy": "x"}, [f"{W}.policy = 'x'", "unknown key"]),
    ({"clock": 1}, [f"{W}.clock = 1", "unknown key"]),
    ({1: 2}, [f"{W} has a key 1", "not a string"]),
    ([("alpha", 1)], [f"{W} = [('alpha', 1)]", "expected a mapping"]),
    (True, [f"{W} = True", "expected a mapping"]),
])
def test_invalid_values_name_key_value_and_accepted(tier, expected):
    message = _error(None, tier)
    for part in expected:
        assert part in message, (part, message)


def test_invalid_inherited_and_top_level_values():
    message = _error({"alpha": 7}, {"cooldown_s": 0.5})
    assert f"backpressure.alpha (inherited by {W}) = 7" in message
    assert "(0, 1]" in message
    message = _error("yes", None)
    assert "backpressure = 'yes' is invalid" in message and "mapping" in message
    message = _error(None, {}, locality="MOON")
    assert "'MOON'" in message and "'LOCAL' or 'REMOTE'" in message and W in message
    # policy_kwargs is one field: inherited whole, even when the tier changes policy_cls
    message = _error({"policy_kwargs": {"ramp_factor": 3}}, {"policy_cls": "DropStorePolicy"})
    assert f"backpressure.policy_kwargs.ramp_factor (inherited by {W}) = 3" in message
    assert "unknown key for DropStorePolicy" in message


def test_vllm_style_config_loads_unchanged():
    det = build_detector_from_config("fs", None, None, {
        "backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy",
        "high_water_s": 0.02, "low_water_s": 0.004})
    assert type(det.policy) is DropStorePolicy and det.high_water_s == 0.02


def test_clock_is_passed_to_built_detectors():
    clock = FakeClock()
    det = build_detector_from_config("fs", None, None, {"warmup_completions": 1}, clock=clock)
    submit = clock()
    clock.advance(0.25)
    det.update(submit, MIB)
    assert det.store_latency_ema == 0.25


# ====================================================================== the clock


@pytest.mark.vllm
def test_detector_follows_a_patched_time_monotonic():
    """Without an injected clock, time is ``time.monotonic()`` looked up at every call, so
    patching it the way vLLM's own tests do (``patch("time.monotonic", return_value=...)``
    in tests/v1/kv_offload/tiering/test_backpressure.py) moves our detector's time too, as
    it moves vLLM's. A default argument bound at import would not see the patch."""
    try:
        from vllm.v1.kv_offload.tiering import backpressure as vllm_bp
    except ImportError:
        vllm_bp = None
    params = dict(high_water_s=HIGH, low_water_s=LOW, alpha=1.0, warmup_completions=1,
                  decay_half_life_s=2.0, cooldown_s=0.0)
    detectors = [EMABackpressureDetector(**params)]
    if vllm_bp is not None:
        detectors.append(vllm_bp.EMABackpressureDetector(**params))
    t0 = 5000.0
    for det in detectors:
        with patch("time.monotonic", return_value=t0):
            det.update(t0 - LOW, MIB)  # seeds the EMA at LOW s/MiB
            det.update(t0 - 0.5, MIB)  # 0.5 s/MiB, measured against the patched time
            assert det.store_latency_ema == 0.5
            assert det.is_under_pressure()
        # 0.5 = 8 x LOW: below LOW after more than 3 half-lives (6 s)
        with patch("time.monotonic", return_value=t0 + 7.9):
            assert not det.is_under_pressure()
            assert det.store_latency_ema == pytest.approx(0.5 * 0.5 ** (7.9 / 2))
    assert detectors[0].clock is None


# ======================================================================= settings

RECORDED: list = []


class RecordingDetector(BackpressureDetector):
    """Registered as ``bp_recording_for_tests.RecordingDetector``: records construction."""

    def __init__(self, threshold: int = 1, policy=None, *, clock=None):
        RECORDED.append(("detector", threshold))
        super().__init__(policy, clock=clock)
        self.threshold = threshold

    def on_store_completed(self, elapsed_s, nbytes): ...
    def is_under_pressure(self): return self.threshold > 5
    def reset(self): self._policy.reset()


class RecordingPolicy(DropStorePolicy):
    def __init__(self, tag: str = ""):
        RECORDED.append(("policy", tag))
        super().__init__()


class PickyDetector(RecordingDetector):
    def __init__(self, threshold: int = 1, policy=None, *, clock=None):
        if threshold < 0:
            raise ValueError("threshold must be >= 0")
        super().__init__(threshold, policy, clock=clock)


@pytest.fixture
def recording(monkeypatch):
    module = types.ModuleType("bp_recording_for_tests")
    module.RecordingDetector, module.RecordingPolicy = RecordingDetector, RecordingPolicy
    module.PickyDetector = PickyDetector
    monkeypatch.setitem(sys.modules, "bp_recording_for_tests", module)
    RECORDED.clear()
    yield RECORDED
    RECORDED.clear()


def test_settings_are_frozen_plain_data_and_build_nothing(recording):
    config = {"backpressure_cls": "bp_recording_for_tests.RecordingDetector", "threshold": 7,
              "policy_cls": "bp_recording_for_tests.RecordingPolicy",
              "policy_kwargs": {"tag": "x"}}
    settings_ = BackpressureSettings.from_config("fs", None, None, config, where=W)
    assert recording == []  # neither class was instantiated
    assert settings_ == BackpressureSettings(
        detector_cls="bp_recording_for_tests.RecordingDetector",
        policy_cls="bp_recording_for_tests.RecordingPolicy", policy_kwargs=(("tag", "x"),),
        extra_kwargs=(("threshold", 7),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings_.threshold = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings_.policy_kwargs = ()
    assert pickle.loads(pickle.dumps(settings_)) == settings_
    det = build_detector(settings_)
    assert recording == [("policy", "x"), ("detector", 7)]
    assert type(det) is RecordingDetector and type(det.policy) is RecordingPolicy
    assert det.is_under_pressure() and not det.should_store(2)


def test_a_custom_constructor_judges_its_settings_when_built(recording):
    """What only a custom constructor can check is checked where it runs: at build time,
    in the scheduler process; the error still names the tier's mapping."""
    config = {"backpressure_cls": "bp_recording_for_tests.PickyDetector", "threshold": -1}
    settings_ = BackpressureSettings.from_config("fs", None, None, config, where=W)
    assert settings_.extra_kwargs == (("threshold", -1),)
    with pytest.raises(BackpressureConfigError, match=r"PickyDetector rejected its settings "
                       r"\{'threshold': -1\}: threshold must be >= 0"):
        build_detector(settings_)
    with pytest.raises(BackpressureConfigError, match=rf"^{re.escape(W)}: .*PickyDetector"):
        build_detector_from_config("fs", None, None, config, where=W)


def test_settings_apply_defaults_and_are_equal_for_equal_configs():
    plain = BackpressureSettings.from_config("fs", None, None, {}, where=W)
    assert plain == BackpressureSettings(
        detector_cls="shmtier.scheduler.backpressure.detector.EMABackpressureDetector",
        high_water_s=0.010, low_water_s=0.002, alpha=0.15, warmup_completions=10,
        decay_half_life_s=2.0, cooldown_s=1.0, failure_threshold=3)
    spelled_out = BackpressureSettings.from_config("fs", "local", {"alpha": 0.15}, {
        "backpressure_cls": "EMABackpressureDetector", "warmup_completions": 10.0,
        "high_water_s": 0.010}, where=W)
    assert spelled_out == plain and hash(spelled_out) == hash(plain)
    assert BackpressureSettings.from_config("fs", None, {}, None) == plain
    assert BackpressureSettings.from_config("obj", None, None, {}) != plain
    assert BackpressureSettings.from_config("fs", None, None, {"alpha": 0.5}) != plain
    assert BackpressureSettings.from_config("fs", None, {"alpha": 0.5}, False) is None
    assert BackpressureSettings.from_config("fs", None, None, None) is None
    throttled = BackpressureSettings.from_config("fs", None,
                                                 {"policy_kwargs": {"ramp_factor": 3}}, {})
    assert throttled.policy_cls == "shmtier.scheduler.backpressure.policy.ThrottledDropPolicy"
    assert throttled.policy_kwargs == (("ramp_factor", 3),)
    with pytest.raises(BackpressureConfigError, match=r"alpha = 2 is invalid"):
        BackpressureSettings.from_config("fs", None, None, {"alpha": 2}, where=W)


def test_build_detector_from_settings_gives_a_working_detector():
    settings_ = BackpressureSettings.from_config(
        "fs", None, {"policy_cls": "DropStorePolicy"},
        {"warmup_completions": 1, "alpha": 1.0, "cooldown_s": 0.0}, where=W)
    clock = FakeClock()
    det = build_detector(settings_, clock=clock)
    assert type(det) is EMABackpressureDetector and type(det.policy) is DropStorePolicy
    assert det.clock is clock and params(det) == dict(
        high_water_s=0.010, low_water_s=0.002, alpha=1.0, warmup_completions=1,
        decay_half_life_s=2.0, cooldown_s=0.0, failure_threshold=3)
    assert det.should_store(1)
    det.update(clock() - 0.001, MIB)  # seeds the EMA
    det.update(clock() - 0.1, MIB)  # 0.1 s/MiB > high water
    assert det.is_under_pressure() and not det.should_store(4)
    assert det.policy.pop_stores_dropped() == (1, 4)
    assert build_detector(settings_) is not det  # a fresh detector per call
    assert build_detector(settings_).clock is None  # reads time.monotonic() at each call


def test_builtin_classes_are_described_as_they_are():
    from shmtier.scheduler.backpressure import validation

    for path, signature in validation.BUILTIN_SIGNATURES.items():
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert validation.constructor_signature(cls) == signature, path
        bases = {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}
        assert validation.BUILTIN_BASES[path] <= bases, path
    assert set(validation.DETECTOR_CLASSES.values()) | set(validation.POLICY_CLASSES.values()) \
        == set(validation.BUILTIN_SIGNATURES)


def test_detector_parameters_are_read_only():
    det, _ = make()
    with pytest.raises(AttributeError):
        det.high_water_s = 1.0
    assert det.high_water_s == HIGH


def _fresh_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True, timeout=120).stdout.strip()


def test_config_parsing_imports_no_detector():
    assert _fresh_python("import shmtier.config, sys; "
                         "print('shmtier.scheduler.backpressure.detector' in sys.modules)") \
        == "False"
    loaded = _fresh_python(
        "import sys\n"
        "from shmtier.scheduler.backpressure import BackpressureSettings\n"
        "s = BackpressureSettings.from_config('fs', None, {'policy_cls': 'DropStorePolicy'},"
        " {'alpha': 0.5}, where='w')\n"
        "assert s is not None and s.alpha == 0.5\n"
        "print(sorted(m for m in sys.modules if m.startswith(('shmtier.scheduler.backpressure.',"
        " 'torch', 'vllm'))))")
    assert loaded == str(["shmtier.scheduler.backpressure.settings",
                          "shmtier.scheduler.backpressure.validation"])


def test_tiering_config_reports_backpressure_errors_as_config_errors():
    from shmtier.config import ConfigError, TieringConfig

    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.backpressure\.alpha = 7"):
        TieringConfig.from_extra_config(
            {"secondary_tiers": [{"type": "fs", "backpressure": {"alpha": 7}}]})


# ======================================================================= metrics


def test_metric_names_and_recording():
    assert bp.BACKPRESSURE_STORE_LATENCY_EMA == (
        "vllm:kv_offload_tiering_backpressure_store_latency_ema")
    assert bp.BACKPRESSURE_STORES_DROPPED == (
        "vllm:kv_offload_tiering_backpressure_stores_dropped")
    assert bp.BACKPRESSURE_BLOCKS_DROPPED == (
        "vllm:kv_offload_tiering_backpressure_blocks_dropped")
    defs = bp.backpressure_metric_definitions()
    assert isinstance(defs[bp.BACKPRESSURE_STORE_LATENCY_EMA], GaugeMetadata)
    assert isinstance(defs[bp.BACKPRESSURE_STORES_DROPPED], CounterMetadata)
    assert isinstance(defs[bp.BACKPRESSURE_BLOCKS_DROPPED], CounterMetadata)
    assert all(d.labelnames == ("tier",) for d in defs.values())

    det, _ = pressured(DropStorePolicy(), ema=2 * HIGH)
    det.should_store(3)
    det.should_store(4)
    stats = OffloadingStats()
    bp.record_backpressure_metrics(stats, det, "1:fs")
    data = stats.data["data"]
    assert data[bp.BACKPRESSURE_STORE_LATENCY_EMA] == {("1:fs",): 2 * HIGH}
    assert data[bp.BACKPRESSURE_STORES_DROPPED] == {("1:fs",): 2}
    assert data[bp.BACKPRESSURE_BLOCKS_DROPPED] == {("1:fs",): 7}
    stats = OffloadingStats()
    bp.record_backpressure_metrics(stats, det, "1:fs")  # popped: no counters again
    assert set(stats.data["data"]) == {bp.BACKPRESSURE_STORE_LATENCY_EMA}


# ============================================================ differential vs vLLM

S_PER_MIB = st.one_of(
    st.sampled_from([0.0, LOW / 2, LOW, (LOW + HIGH) / 2, HIGH, 1.5 * HIGH, 2 * HIGH,
                     3 * HIGH, 5 * HIGH]),
    st.floats(0.0, 6 * HIGH, allow_nan=False),
)
REPEAT = st.integers(1, 12)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0]),
                                                st.floats(0.0, 10.0))),
        st.tuples(st.just("complete"), S_PER_MIB,
                  st.sampled_from([0, MIB // 4, MIB, 3 * MIB, 8 * MIB]), REPEAT),
        st.tuples(st.just("fail"), REPEAT),
        st.tuples(st.just("should_store"), st.integers(1, 8), REPEAT),
        st.tuples(st.just("should_store"), st.integers(1, 8), REPEAT),
        st.tuples(st.just("set_ema"), S_PER_MIB),
        st.tuples(st.just("is_under_pressure")),
        st.tuples(st.just("pop")),
        st.tuples(st.just("reset")),
    ),
    min_size=1,
    max_size=80,
)
CONFIGS = st.fixed_dictionaries({
    "alpha": st.sampled_from([0.15, 0.5, 1.0]),
    "warmup_completions": st.sampled_from([0, 1, 3, 10]),
    "decay_half_life_s": st.sampled_from([0.0, 0.5, 2.0]),
    "cooldown_s": st.sampled_from([0.0, 1.0, 3.0]),
    "failure_threshold": st.sampled_from([None, 1, 3]),
})
POLICIES = st.sampled_from([("ThrottledDropPolicy", 2.0), ("ThrottledDropPolicy", 3.0),
                            ("DropStorePolicy", None), (None, None)])


class _FakeTime:
    """Stands in for the ``time`` module inside vLLM's backpressure module."""

    def __init__(self, clock: FakeClock):
        self.monotonic = clock


def _drive(config: dict, policy: tuple, ops: list) -> None:
    """Run ``ops`` on vLLM's detector and ours (same fake clock); compare every step."""
    vllm_bp = pytest.importorskip("vllm.v1.kv_offload.tiering.backpressure")
    if "failure_threshold" not in inspect.signature(
            vllm_bp.EMABackpressureDetector.__init__).parameters:
        pytest.skip("vLLM 0.32's detector counts no failures (0.33 added failure_threshold); "
                    "shmtier keeps 0.33's detector on every vLLM (docs/vllm-contract.md §15)")
    clock = FakeClock(1000.0)
    name, ramp = policy

    def make_policy(module):
        if name is None:
            return None
        cls = getattr(module, name)
        return cls(ramp_factor=ramp) if ramp is not None else cls()

    params = dict(config, high_water_s=HIGH, low_water_s=LOW)
    ours = EMABackpressureDetector(policy=make_policy(bp), clock=clock, **params)
    theirs = vllm_bp.EMABackpressureDetector(policy=make_policy(vllm_bp), **params)
    saved = vllm_bp.time
    vllm_bp.time = _FakeTime(clock)  # vLLM reads time.monotonic() from its module global
    try:
        for step, op in enumerate(ops):
            kind = op[0]
            repeat = op[-1] if kind in ("complete", "fail", "should_store") else 1
            for _ in range(repeat):
                if kind == "advance":
                    clock.advance(op[1])
                    got = want = None
                elif kind == "complete":
                    nbytes = op[2]
                    submit = clock() - op[1] * nbytes / MIB
                    got, want = ours.update(submit, nbytes), theirs.update(submit, nbytes)
                elif kind == "fail":
                    got, want = ours.on_store_failed(), theirs.on_store_failed()
                elif kind == "should_store":
                    got, want = ours.should_store(op[1]), theirs.should_store(op[1])
                elif kind == "set_ema":
                    ours.store_latency_ema = theirs.store_latency_ema = op[1]
                    got = want = None
                elif kind == "is_under_pressure":
                    got, want = ours.is_under_pressure(), theirs.is_under_pressure()
                elif kind == "pop":
                    got = ours.policy.pop_stores_dropped()
                    want = theirs.policy.pop_stores_dropped()
                else:
                    got, want = ours.reset(), theirs.reset()
                context = (config, policy, step, op)
                assert got == want, context
                assert ours._under_pressure == theirs._under_pressure, context
                assert ours.store_latency_ema == theirs.store_latency_ema, context
                assert ours.stats == theirs.stats, context
                assert ours.is_healthy() == theirs.is_healthy(), context
        assert ours.policy.pop_stores_dropped() == theirs.policy.pop_stores_dropped()
    finally:
        vllm_bp.time = saved


@pytest.mark.vllm
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIGS, policy=POLICIES, ops=OPS)
def test_matches_vllm_decision_for_decision(config, policy, ops):
    _drive(config, policy, ops)


EXACT = [0.0, LOW / 2, LOW, (LOW + HIGH) / 2, HIGH, 1.5 * HIGH, 2 * HIGH, 2.5 * HIGH,
         3 * HIGH, 5 * HIGH]


def _seeded_ops(rng: random.Random, n: int) -> list:
    ops = []
    for _ in range(n):
        r = rng.random()
        x = rng.choice(EXACT) if rng.random() < 0.6 else rng.uniform(0, 6 * HIGH)
        if r < 0.15:
            ops.append(("advance", rng.choice([0.0, 0.25, 0.5, 1.0, 2.0, rng.uniform(0, 8)])))
        elif r < 0.40:
            ops.append(("complete", x, rng.choice([0, MIB // 4, MIB, 4 * MIB]),
                        rng.choice([1, 1, 2, 5, 12])))
        elif r < 0.47:
            ops.append(("fail", rng.randint(1, 4)))
        elif r < 0.80:
            ops.append(("should_store", rng.randint(1, 8), rng.randint(1, 6)))
        elif r < 0.88:
            ops.append(("set_ema", x))
        elif r < 0.94:
            ops.append(("is_under_pressure",))
        elif r < 0.99:
            ops.append(("pop",))
        else:
            ops.append(("reset",))
    return ops


@pytest.mark.vllm
@pytest.mark.parametrize("seed", range(8))
def test_matches_vllm_on_seeded_long_runs(seed):
    """Reproducible companion of the hypothesis test: long runs in every configuration."""
    rng = random.Random(seed)
    for _ in range(40):
        config = {"alpha": rng.choice([0.15, 0.5, 1.0]),
                  "warmup_completions": rng.choice([0, 1, 3, 10]),
                  "decay_half_life_s": rng.choice([0.0, 0.5, 2.0]),
                  "cooldown_s": rng.choice([0.0, 1.0, 3.0]),
                  "failure_threshold": rng.choice([None, 1, 3])}
        policy = rng.choice([("ThrottledDropPolicy", 2.0), ("ThrottledDropPolicy", 3.0),
                             ("DropStorePolicy", None), (None, None)])
        _drive(config, policy, _seeded_ops(rng, 150))
