"""``--busy N`` (shmtier/bench/busy.py): real spinning processes at niceness 0 while the
bench runs, gone after it, also when a run fails or the bench itself is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from shmtier.bench.busy import BusyHost


def _gone(pid: int) -> bool:
    """No such process, or a zombie (it exited; its new parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _nice_and_cpu(pid: int) -> tuple[int, int]:
    """``pid``'s niceness and its CPU ticks (utime + stime), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[16]), int(fields[11]) + int(fields[12])


def _can_run_at_zero() -> bool:
    """Whether this process may set niceness 0 (it runs at 0, or may lower its niceness)."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    if mine <= 0:
        return True
    try:
        probe = subprocess.run([sys.executable, "-c",
                                "import os; os.setpriority(os.PRIO_PROCESS, 0, 0)"],
                               capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


def test_busy_host_spins_n_processes_at_niceness_zero_and_stops_them():
    with BusyHost(2) as busy:
        pids = [p.pid for p in busy.procs]
        assert len(set(pids)) == 2
        want = 0 if _can_run_at_zero() else os.getpriority(os.PRIO_PROCESS, 0)
        assert busy.niceness == [want, want]
        before = [_nice_and_cpu(pid) for pid in pids]
        assert [n for n, _ in before] == [want, want]
        deadline = time.monotonic() + 10
        while any(_nice_and_cpu(pid)[1] <= cpu for pid, (_, cpu) in zip(pids, before)):
            assert time.monotonic() < deadline, "the spinners did not use the CPU"
            time.sleep(0.05)
        assert os.sched_getscheduler(pids[0]) == os.SCHED_OTHER
        text = busy.describe()
        assert text.startswith("busy host: 2 processes spinning at niceness") and "--busy 2" in text
    assert busy.procs == [] and all(_gone(pid) for pid in pids)
    assert busy.as_dict() == {"processes": 2, "niceness": [want, want]}


def test_a_failing_run_stops_the_spinners_too():
    with pytest.raises(RuntimeError, match="a run failed"):
        with BusyHost(1) as busy:
            pids = [p.pid for p in busy.procs]
            raise RuntimeError("a run failed")
    assert all(_gone(pid) for pid in pids)


def test_no_busy_process_without_busy_and_a_bad_count_is_refused():
    with BusyHost(0) as busy:
        assert busy.procs == [] and busy.describe() == "busy host: none (no --busy)"
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"--busy .*: expected a number of processes >= 0"):
            BusyHost(bad)


def test_the_spinners_of_a_sigkilled_bench_exit_by_themselves():
    code = ("import sys, time; from shmtier.bench.busy import BusyHost\n"
            "with BusyHost(1) as b:\n"
            "    print(b.procs[0].pid, flush=True); time.sleep(60)\n")
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    spinner = None
    try:
        spinner = int(bench.stdout.readline())
        assert not _gone(spinner)
        bench.kill()
        bench.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(spinner):
            assert time.monotonic() < deadline, "a spinner outlived its SIGKILLed bench"
            time.sleep(0.02)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
        bench.stdout.close()
        if spinner is not None and not _gone(spinner):
            os.kill(spinner, signal.SIGKILL)


@pytest.mark.parametrize("variant, lanes", [("lane0", 0), ("lane1+raw", 1), ("", 1)])
def test_a_lane_variant_sets_the_promotion_workers_of_the_benchs_shmtier(engine_id, tmp_path,
                                                                         variant, lanes):
    """``shmtier@laneN`` (the before/after of issue 29's figures): its tier workers run in
    the lanes it names; plain ``shmtier`` keeps the default (1 of 2)."""
    from shmtier.bench.driver import Config
    from shmtier.bench.managers import known_manager, make_shmtier

    assert known_manager(f"shmtier@{variant}" if variant else "shmtier")
    assert not known_manager("shmtier@laneX") and not known_manager("vllm@lane1")
    cfg = Config(chunk_bytes=8192, cpu_bytes=16 * 8192, step_ms=2, max_running=4, batch=2,
                 workers=2, dir=str(tmp_path))
    mut = make_shmtier(cfg, str(tmp_path), engine_id, variant)
    try:
        assert mut.pool.config.options.promotion_workers == lanes
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        want = [os.SCHED_BATCH, os.SCHED_OTHER if lanes else os.SCHED_BATCH]
        assert [os.sched_getscheduler(pid) for pid in mut.worker_pids] == want
        assert os.getpriority(os.PRIO_PROCESS, mut.worker_pids[1]) == (
            mine if lanes else min(19, mine + 10))
    finally:
        mut.close()
