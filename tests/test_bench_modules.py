"""The bench/ scripts run as modules of the ``bench`` package from a checkout's root
(``python -m bench.<name>``, as bench/README.md says), each importing what it shares from
``shmtier.bench`` or its sibling modules, never by editing ``sys.path``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")


def run_module(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_bench_script_runs_as_a_module(name):
    got = run_module(f"bench.{name}", "--help")
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("usage:"), got.stdout
    assert "sys.path" not in (REPO / "bench" / f"{name}.py").read_text()


def test_a_bench_script_runs_its_work_as_a_module():
    """The cheapest real run: the admission model over the chat trace."""
    got = run_module("bench.admission_model", "--workloads", "chat")
    assert got.returncode == 0, got.stderr
    rows = [line.split() for line in got.stdout.splitlines() if line.startswith("chat ")]
    assert [r[1] for r in rows] == ["all", "second_touch"], got.stdout
    for row in rows:
        assert 0.0 <= float(row[-8]) <= 1.0  # the CPU tier's hit rate


def test_the_bench_readme_runs_them_as_modules():
    text = (REPO / "bench" / "README.md").read_text()
    assert "python bench/" not in text
    for name in SCRIPTS:
        if f"{name}.py" in text:
            assert f"-m bench.{name}" in text, f"bench/README.md names {name}.py but no command"


def test_the_idle_step_bench_measures_each_call_and_leaves_nothing(tmp_path):
    """bench/idle_step.py run tiny: every call's figures for each manager, a ratio to
    vLLM's for each shmtier variant, and no segment, semaphore or directory left."""
    import json

    out = tmp_path / "idle.json"
    got = run_module("bench.idle_step", "--repeats", "1", "--steps", "5",
                     "--managers", "shmtier,shmtier@wincpu,vllm", "--json", str(out))
    assert got.returncode == 0, got.stdout + got.stderr
    figures = json.loads(out.read_text())["figures"]
    for name in ("shmtier", "shmtier@wincpu", "vllm"):
        for call in ("on_schedule_end", "has_pending_work", "get_stats", "take_events", "step"):
            p50, lo, hi = figures[name][call]["p50"]
            assert 0 < lo <= p50 <= hi
    assert "against vLLM, ratio of the medians (p50): shmtier, shmtier@wincpu" in got.stdout
    assert not [e for e in os.listdir("/dev/shm") if "bench-idle-" in e]
    import tempfile

    assert not list(pathlib.Path(tempfile.gettempdir()).glob("idle-step-*"))


def test_the_fs_bench_limits_read_the_device_with_reads_in_flight(tmp_path):
    """bench/fs_tier.py's big-file limits, run tiny: every line has a figure (the O_DIRECT
    ones with 1 and ``IN_FLIGHT`` reads in flight, where the filesystem takes O_DIRECT),
    and the file is gone."""
    from bench import fs_tier

    res = fs_tier.bench_big_file(str(tmp_path), 16 * fs_tier.MIB, 1)
    assert res["read buffered warm"][0] > 0
    if "O_DIRECT" in res:  # tmpfs: O_DIRECT not permitted
        assert res["O_DIRECT"] == []
    else:
        for n in fs_tier.IN_FLIGHT:
            assert res[f"read O_DIRECT, {n} in flight"][0] > 0
    assert list(tmp_path.iterdir()) == []
