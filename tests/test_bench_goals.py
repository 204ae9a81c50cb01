"""Issue 14's goal table and issue 29's per-step fixed costs (shmtier/bench/goals.py), and
bench/goals.py over saved sets: fixed summaries in, verdicts out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shmtier.bench.goals import FIXED_COSTS, GOALS, evaluate, format_goals, whole_run_cpu_s

REPO = Path(__file__).resolve().parents[1]


def summary(**over) -> dict:
    """A run's summary with every figure the goals read (vLLM-like values by default)."""
    s = {"step_us_p99": 1000.0, "step_us_p999": 2000.0, "step_us_max": 4000.0,
         "step_us_p50": 100.0, "spec_cpu_s": 4.0, "cpu_s": 5.0, "workers_cpu_s": None,
         "promo_ms_p50": 50.0, "hit_fs": 0.4, "disk_per_logical": 1.0}
    s.update(over)
    return s


def shm_summary(**over) -> dict:
    """A shmtier run that meets every goal against ``summary()`` by default."""
    s = summary(step_us_p99=400.0, step_us_p999=500.0, step_us_max=1000.0, step_us_p50=90.0,
                spec_cpu_s=0.8, cpu_s=3.0, workers_cpu_s=4.0, promo_ms_p50=10.0, hit_fs=0.41,
                disk_per_logical=0.66)
    s.update(over)
    return s


def by_figure(rows):
    return {r["figure"]: r for r in rows}


def test_every_goal_met_and_the_ratio_is_of_the_medians():
    rows = evaluate([shm_summary(), shm_summary(step_us_p99=300.0), shm_summary(step_us_p99=2000.0)],
                    [summary()] * 3)
    assert [r["figure"] for r in rows] == [g.figure for g in GOALS]
    assert all(r["met"] for r in rows)
    p99 = by_figure(rows)["step time p99"]
    assert p99["ratio"] == pytest.approx(0.4)  # median 400 / median 1000, not a mean of ratios
    assert p99["pairs"] == pytest.approx([0.4, 0.3, 2.0])
    assert p99["pairs_within"] == 2
    assert format_goals(rows)[-1] == "9 of 9 goals met (0 n/a)"


def test_whole_run_cpu_adds_the_tier_workers():
    assert whole_run_cpu_s(summary(cpu_s=5.0, workers_cpu_s=None)) == 5.0
    assert whole_run_cpu_s(shm_summary(cpu_s=3.0, workers_cpu_s=4.0)) == 7.0
    row = by_figure(evaluate([shm_summary(cpu_s=3.0, workers_cpu_s=5.0)], [summary(cpu_s=5.0)]))
    whole = row["scheduler process + tier workers, whole run"]
    assert whole["ratio"] == pytest.approx(1.6) and whole["met"] is False


def test_each_bound_is_judged_in_its_direction():
    rows = by_figure(evaluate(
        [shm_summary(step_us_p999=700.0, hit_fs=0.39, step_us_p50=100.0, disk_per_logical=0.71)],
        [summary()]))
    assert rows["step time p99.9"]["met"] is False          # 0.35 > 0.3
    assert rows["hit rate (secondary tier)"]["met"] is False  # 0.975 < 1.0: at least
    assert rows["step time p50"]["met"] is True               # exactly 1.0 is within
    disk = rows["bytes on disk ÷ logical"]                    # shmtier's own figure
    assert disk["absolute"] and disk["ratio"] == pytest.approx(0.71) and disk["met"] is False


def test_a_figure_a_run_lacks_is_na_not_a_verdict():
    rows = evaluate([shm_summary(promo_ms_p50=None, spec_cpu_s=None)], [summary()])
    na = [r["figure"] for r in rows if r["met"] is None]
    assert na == ["scheduler-process CPU in the spec", "promotion p50"]
    assert format_goals(rows)[-1] == "7 of 7 goals met (2 n/a)"
    lines = "\n".join(format_goals(rows))
    assert "n/a" in lines and "NOT MET" not in lines


def per_step(get_stats: float, on_schedule_end: float, cpu_share: float = 0.8) -> dict:
    """The per-kind µs per step a summary carries (wall; on-CPU ``cpu_share`` of it)."""
    wall = {"get_stats": get_stats, "on_schedule_end": on_schedule_end}
    return {"per_kind_us_per_step": wall,
            "per_kind_cpu_us_per_step": {k: v * cpu_share for k, v in wall.items()}}


def test_fixed_costs_judge_each_call_s_time_per_step_against_vllm_s_per_pair():
    """get_stats and on_schedule_end, wall and on-CPU µs per step: the ratio of the
    medians against 1.0, the spread per run pair; a summary without them is n/a."""
    shm = [summary(**per_step(40.0, 50.0)), summary(**per_step(44.0, 70.0, 0.5)),
           summary(**per_step(38.0, 40.0))]
    vllm = [summary(**per_step(50.0, 45.0)), summary(**per_step(52.0, 60.0)),
            summary(**per_step(48.0, 50.0))]
    rows = by_figure(evaluate(shm, vllm, FIXED_COSTS))
    assert list(rows) == [g.figure for g in FIXED_COSTS]
    gs = rows["get_stats µs per step, wall"]
    assert gs["ratio"] == pytest.approx(40.0 / 50.0) and gs["met"] and gs["pairs_within"] == 3
    ose = rows["on_schedule_end µs per step, wall"]
    assert ose["ratio"] == pytest.approx(1.0) and ose["met"]  # medians 50 and 50
    assert ose["pairs"] == pytest.approx([50 / 45, 70 / 60, 40 / 50]) and ose["pairs_within"] == 1
    cpu = rows["on_schedule_end µs per step, on-CPU"]
    assert cpu["shm"] == pytest.approx((35.0, 32.0, 40.0)) and cpu["ratio"] == pytest.approx(35 / 40)
    assert all(r["met"] is None for r in evaluate([shm_summary()], [summary()], FIXED_COSTS))
    assert format_goals(evaluate(shm, vllm, FIXED_COSTS))[-1] == "4 of 4 goals met (0 n/a)"
    assert format_goals(evaluate(vllm, shm, FIXED_COSTS))[-1] == "1 of 4 goals met (0 n/a)"


def test_evaluate_needs_both_managers():
    with pytest.raises(ValueError, match="both managers"):
        evaluate([], [summary()])


def _set(path: Path, shm: list, vllm: list, top: dict | None = None, **args) -> Path:
    base = {"chunk_kib": 256, "cpu_mib": 128, "workload": "chat", "seed": 1234}
    base.update(args)
    path.write_text(json.dumps({"bench": "tiering_steps", "args": base,
                                "summaries": {"shmtier": shm, "vllm": vllm}, **(top or {})}))
    return path


def _goals_cli(*argv):
    return subprocess.run([sys.executable, str(REPO / "bench" / "goals.py"), *map(str, argv)],
                          capture_output=True, text=True, timeout=60)


def test_cli_pools_sets_of_one_experiment(tmp_path):
    a = _set(tmp_path / "a.json", [shm_summary(step_us_p999=900.0)], [summary()])
    b = _set(tmp_path / "b.json", [shm_summary(), shm_summary()], [summary(), summary()])
    out = _goals_cli(a, b)
    assert out.returncode == 0, out.stderr
    assert "over 3 run pairs from 2 set(s)" in out.stdout
    line = next(x for x in out.stdout.splitlines() if "step time p99.9" in x)
    assert line.split()[-4:] == ["2", "of", "3", "met"]  # median 500 / 2000 = 0.25
    assert "9 of 9 goals met" in out.stdout
    assert "issue 29's per-step fixed costs" in out.stdout and "0 of 0 goals met (4 n/a)" in out.stdout


def test_cli_refuses_sets_of_different_experiments_and_missing_managers(tmp_path):
    a = _set(tmp_path / "a.json", [shm_summary()], [summary()])
    b = _set(tmp_path / "b.json", [shm_summary()], [summary()], chunk_kib=1408)
    out = _goals_cli(a, b)
    assert out.returncode == 2
    assert "b.json: another experiment" in out.stderr and "chunk_kib 256 vs 1408" in out.stderr
    c = _set(tmp_path / "c.json", [shm_summary()], [])
    out = _goals_cli(c)
    assert out.returncode == 2 and "no runs of 'vllm'" in out.stderr
    out = _goals_cli(a, "--manager", "shmtier@raw")
    assert out.returncode == 2 and "no runs of 'shmtier@raw'" in out.stderr


def test_cli_pools_only_sets_against_the_same_vllm(tmp_path):
    """A set names the vLLM it ran against (``baseline``; a set saved before that entry
    existed, by its vLLM note): sets against 0.33 and 0.34 are not pooled."""
    old = _set(tmp_path / "old.json", [shm_summary()], [summary()],
               top={"vllm": "vLLM 0.33.0 imported in 5.2 s (not timed)"})
    v33 = _set(tmp_path / "v33.json", [shm_summary()], [summary()],
               top={"baseline": {"baseline": "vLLM 0.33.0 TieringOffloadingSpec"}})
    v34 = _set(tmp_path / "v34.json", [shm_summary()], [summary()],
               top={"baseline": {"baseline": "vLLM 0.34.0 TieringOffloadingSpec"}})
    out = _goals_cli(old, v33)
    assert out.returncode == 0, out.stderr
    assert "shmtier vs vLLM 0.33.0 TieringOffloadingSpec" in out.stdout
    assert out.stdout.splitlines()[1].split()[-8:-6] == ["vLLM", "0.33.0"]  # the column head
    out = _goals_cli(v33, v34)
    assert out.returncode == 2
    assert ("v34.json: another experiment" in out.stderr and "baseline 'vLLM 0.33.0 "
            "TieringOffloadingSpec' vs 'vLLM 0.34.0 TieringOffloadingSpec'" in out.stderr)
