"""The step-window poll thread (shmtier/scheduler/tiering/window_poll.py): its plan from
given times (pure), the thread with a real lock, and a real engine whose fs tier's
finished cascades are collected between steps, with no manager call."""

from __future__ import annotations

import os
import threading
import time

import pytest
from fs_engine import END, PENDING, engines, key  # noqa: F401

from shmtier import metrics
from shmtier.config import ConfigError, TieringConfig
from shmtier.contract import ReqContext
from shmtier.scheduler.tiering.window_poll import (IDLE_AFTER_PERIODS, IDLE_SLEEP_MAX_S,
                                                   MIN_STEP_ENDS,
                                                   ROUND_SPACING_SHARE,
                                                   STEP_ENDS_KEPT, StepRhythm,
                                                   StepWindowPollThread)


def rhythm(ends, window=0.8, interval_s=0.001) -> StepRhythm:
    r = StepRhythm(window, interval_s)
    for t in ends:
        r.step_ended(t)
    return r


# --- the plan, from given times ---

def test_no_round_before_three_step_ends():
    assert rhythm([]).plan(1.0) == (False, IDLE_SLEEP_MAX_S)
    assert rhythm([0.0, 0.005]).plan(0.006) == (False, IDLE_SLEEP_MAX_S)


def test_rounds_run_an_interval_apart_while_work_is_in_flight_then_sleep_past_the_next_step():
    r = rhythm([0.0, 0.005, 0.010])  # period 5 ms: the window is 11-14 ms
    assert r.period() == pytest.approx(0.005)
    poll, sleep = r.plan(0.0102)  # too early: the engine thread may still be at work
    assert not poll and sleep == pytest.approx(0.0008)
    poll, sleep = r.plan(0.011)
    assert poll and sleep == pytest.approx(0.001)  # the next round, one interval on
    r.round_ran(0.011, left_work=True)
    assert r.plan(0.0112) == (False, pytest.approx(0.0008))  # planned again after it
    poll, sleep = r.plan(0.012)
    assert poll and sleep == pytest.approx(0.001)
    r.round_ran(0.012, left_work=True)
    poll, sleep = r.plan(0.0131)  # the next round would pass the window's end (14 ms):
    assert poll and sleep == pytest.approx(0.0029)  # sleep to 16 ms, past the next step end
    r.round_ran(0.0131, left_work=True)
    poll, sleep = r.plan(0.0141)  # past the window: no round
    assert not poll and sleep == pytest.approx(0.0019)
    r.step_ended(0.015)  # the next step: its window is 16-19 ms
    poll, _ = r.plan(0.016)
    assert poll


def test_a_round_that_left_nothing_in_flight_is_the_last_until_the_next_step():
    r = rhythm([0.0, 0.005, 0.010])
    assert r.plan(0.011)[0]
    r.round_ran(0.011, left_work=False)
    assert r.plan(0.0111) == (False, pytest.approx(0.0049))  # on to the next step's window
    assert r.plan(0.013) == (False, pytest.approx(0.003))  # a capped sleep's wake: no round
    r.step_ended(0.015)  # a new step may have sent work: rounds again
    assert r.plan(0.016)[0]


def test_a_round_missed_for_a_held_lock_is_tried_again_an_interval_later():
    r = rhythm([0.0, 0.005, 0.010])
    poll, sleep = r.plan(0.011)
    assert poll  # ... and the lock was held: no round_ran
    assert r.plan(0.011 + sleep)[0]


def test_a_wake_up_a_little_early_runs_its_round_instead_of_sleeping_again():
    r = rhythm([0.0, 0.005, 0.010])
    poll, sleep = r.plan(0.0108)  # a quarter interval early for the first round
    assert poll and sleep == pytest.approx(0.001)
    r.round_ran(0.0108)
    assert r.plan(0.0116)[0]  # and for the next
    r.round_ran(0.0116)
    r.step_ended(0.0152)  # a step that ended late: its window opens at 16.2 ms
    poll, _ = r.plan(0.016)  # the wake planned for 16 ms
    assert poll


def test_a_window_too_short_for_two_rounds_has_one():
    r = rhythm([0.0, 0.005, 0.010], window=0.3)  # the window: 11-11.5 ms
    poll, sleep = r.plan(0.011)
    assert poll and sleep == pytest.approx(0.005)  # straight to the next step's window
    r.round_ran(0.011)
    assert not r.plan(0.0113)[0]
    assert not r.plan(0.012)[0]


def test_the_period_is_worked_out_again_at_each_step_end():
    r = rhythm([0.0, 0.005, 0.010])
    assert r.period() == pytest.approx(0.005)
    r.step_ended(0.030)
    r.step_ended(0.050)  # gaps 5, 5, 20, 20 ms
    assert r.period() == pytest.approx(0.020)


def test_a_late_step_backs_off_and_an_idle_engine_gets_a_round_at_each_wake():
    r = rhythm([0.0, 0.005, 0.010])
    poll, sleep = r.plan(0.020)  # 10 ms after the last end, no new one: a long step?
    assert not poll and sleep == pytest.approx(0.0025)
    poll, sleep = r.plan(0.010 + IDLE_AFTER_PERIODS * 0.005)  # idle: what it left goes
    assert poll
    poll, sleep = r.plan(10.0)
    assert poll and sleep == IDLE_SLEEP_MAX_S


def test_quiet_says_a_round_since_the_last_step_end_left_nothing_in_flight():
    r = rhythm([0.0])
    assert not r.quiet  # no round yet
    r.round_ran(0.001, left_work=True)
    assert not r.quiet
    r.round_ran(0.004, left_work=False)
    assert r.quiet
    r.step_ended(0.005)  # the step may have sent work
    assert not r.quiet


def test_came_says_a_round_ran_since_the_last_step_end():
    r = rhythm([0.0])
    assert not r.came
    r.round_ran(0.001, left_work=True)
    assert r.came and not r.quiet
    r.step_ended(0.005)
    assert not r.came


def test_rounds_came_says_whether_a_round_ran_between_the_last_two_step_ends():
    r = rhythm([0.0])
    assert not r.rounds_came
    r.round_ran(0.001)
    r.step_ended(0.005)
    assert r.rounds_came
    r.step_ended(0.010)  # no round in between
    assert not r.rounds_came


def test_with_long_steps_rounds_come_a_share_of_the_period_apart():
    r = rhythm([0.0, 1.0, 2.0], window=0.9)
    assert r.plan(2.0 + ROUND_SPACING_SHARE * 0.7) == (False, pytest.approx(
        ROUND_SPACING_SHARE * 0.3))
    poll, sleep = r.plan(2.0 + ROUND_SPACING_SHARE)
    assert poll and sleep == pytest.approx(ROUND_SPACING_SHARE)
    r.round_ran(2.0 + ROUND_SPACING_SHARE)
    for now in (2.15, 2.2):  # the thread's capped sleeps wake it: no round between
        assert not r.plan(now)[0]
    assert r.plan(2.0 + 2 * ROUND_SPACING_SHARE)[0]


def test_the_period_is_the_median_gap_so_one_idle_pause_does_not_move_it():
    r = rhythm([0.0, 0.005, 0.010, 5.010, 5.015, 5.020])
    assert r.period() == pytest.approx(0.005)
    assert r.plan(5.021)[0]


@pytest.mark.parametrize("window, interval_s", [(0.0, 0.001), (1.0, 0.001), (0.5, 0.0)])
def test_a_rhythm_without_a_window_or_interval_is_refused(window, interval_s):
    with pytest.raises(ValueError):
        StepRhythm(window, interval_s)


# --- the thread, with a real lock ---

class EngineThread:
    """Stands in for the engine thread: steps of ``busy_s`` holding the lock, then
    ``step_ended``, then a forward pass of ``forward_s`` without it."""

    def __init__(self, busy_s: float, forward_s: float):
        self.lock = threading.Lock()
        self.busy_s, self.forward_s = busy_s, forward_s
        self.rounds: list[tuple[float, bool]] = []  # (time, the lock was held)
        self.ends: list[float] = []

    def poll(self) -> None:
        self.rounds.append((time.monotonic(), self.lock.locked()))

    def run(self, r: StepRhythm, steps: int) -> None:
        for _ in range(steps):
            with self.lock:
                time.sleep(self.busy_s)
                now = time.monotonic()
                r.step_ended(now)
                self.ends.append(now)
            time.sleep(self.forward_s)


@pytest.fixture
def window_thread():
    made = []

    def start(lock, poll, r):
        t = StepWindowPollThread(lock, poll, r)
        made.append(t)
        return t

    yield start
    for t in made:
        assert t.stop()


def test_rounds_run_between_steps_under_the_lock_and_never_without_a_rhythm(window_thread):
    eng = EngineThread(busy_s=0.004, forward_s=0.036)
    r = StepRhythm(0.5, 0.002)
    t = window_thread(eng.lock, eng.poll, r)
    time.sleep(0.2)
    assert eng.rounds == [], "rounds ran before any step"
    eng.run(r, 15)
    assert t.rounds >= 10, (t.rounds, t.missed)
    assert all(held for _, held in eng.rounds), "a round ran without the lock"
    # every round ran after a step ended, inside its window (0.5 of the 40 ms period;
    # 8 ms of slack for a late wake-up, still well before the next step at 36 ms)
    for at, _ in list(eng.rounds):
        before = [e for e in eng.ends if e <= at]
        assert before, "a round before the first step end"
        assert at - before[-1] < 0.5 * 0.04 + 0.008, "a round outside the window"


@pytest.mark.parametrize("left_work", [True, False])
def test_a_window_has_rounds_after_the_first_only_while_work_is_in_flight(window_thread,
                                                                         left_work):
    eng = EngineThread(busy_s=0.001, forward_s=0.012)
    real_poll = eng.poll

    def poll():
        real_poll()
        return left_work

    r = StepRhythm(0.8, 0.001)
    window_thread(eng.lock, poll, r)
    eng.run(r, 40)
    ends = eng.ends[MIN_STEP_ENDS - 1:-1]  # windows the thread had a rhythm for
    per_window = [sum(1 for at, _ in eng.rounds if a < at < b) for a, b in zip(ends, ends[1:])]
    more = sum(1 for n in per_window if n >= 2) / len(per_window)
    if left_work:
        assert more >= 0.5, per_window
    else:
        assert more <= 0.1, per_window


def test_the_thread_runs_sched_batch(window_thread):
    eng = EngineThread(0.001, 0.01)
    t = window_thread(eng.lock, eng.poll, StepRhythm(0.8, 0.001))
    deadline = time.monotonic() + 5
    while os.sched_getscheduler(t.native_id) != os.SCHED_BATCH:
        assert time.monotonic() < deadline, "the thread did not switch to SCHED_BATCH"
        time.sleep(0.005)
    assert os.sched_getscheduler(0) != os.SCHED_BATCH  # the caller's thread is untouched


def test_on_the_engine_cpu_the_rounds_run_where_the_engine_thread_ended_its_step():
    """``tier_poll_window_cpu: "engine"``: the thread's rounds run on the CPU the engine
    thread ended its last step on, and move with it (here the engine thread is pinned to
    each allowed CPU in turn); without it the thread keeps the process's CPUs."""
    from shmtier.scheduler.tiering.window_poll import cpu_reader

    getcpu = cpu_reader()
    allowed = sorted(os.sched_getaffinity(0))
    eng = EngineThread(busy_s=0.001, forward_s=0.01)
    r = StepRhythm(0.8, 0.001)
    plain = StepWindowPollThread(eng.lock, eng.poll, StepRhythm(0.8, 0.001))
    t = StepWindowPollThread(eng.lock, eng.poll, r, on_engine_cpu=True)
    try:
        for cpu in allowed[:2]:
            os.sched_setaffinity(0, {cpu})  # this (engine) thread only
            deadline = time.monotonic() + 10
            while os.sched_getaffinity(t.native_id) != {cpu}:
                assert time.monotonic() < deadline, (cpu, os.sched_getaffinity(t.native_id))
                with eng.lock:
                    r.step_ended(time.monotonic(), getcpu())
                time.sleep(eng.forward_s)
            assert r.engine_cpu == cpu
        assert os.sched_getaffinity(plain.native_id) == set(allowed)
    finally:
        os.sched_setaffinity(0, set(allowed))
        assert t.stop() and plain.stop()


def test_the_window_cpu_option_names_the_key_and_what_it_accepts():
    assert TieringConfig.from_extra_config({}).tier_poll_window_cpu == "any"
    assert TieringConfig.from_extra_config(
        {"tier_poll_window_cpu": "engine"}).tier_poll_window_cpu == "engine"
    with pytest.raises(ConfigError) as err:
        TieringConfig.from_extra_config({"tier_poll_window_cpu": "scheduler"})
    text = str(err.value)
    assert "['tier_poll_window_cpu']" in text and "'scheduler' is invalid" in text
    assert "'any'" in text and "'engine'" in text


def test_a_failing_round_is_logged_and_the_thread_goes_on(window_thread, caplog):
    eng = EngineThread(busy_s=0.002, forward_s=0.02)
    calls = []

    def poll():
        calls.append(1)
        raise RuntimeError("tier broke")

    r = StepRhythm(0.8, 0.002)
    t = window_thread(eng.lock, poll, r)
    eng.run(r, 12)
    assert len(calls) >= 3 and t.is_alive()
    assert "step-window poll round failed" in caplog.text
    assert not eng.lock.locked()


# --- a real engine ---

def _submitted_cascade(engine) -> None:
    """Store two keys and end the step that hands their cascade to the tier workers."""
    ctx = ReqContext("r0", [])
    engine.offload([key(1), key(2)], 0, ctx)
    with engine.manager.lock:
        engine.manager.on_schedule_end(END)


@pytest.mark.parametrize("window", [0.9, 0.0], ids=["window", "off"])
def test_the_window_collects_a_finished_cascade_before_the_next_step(engines, tmp_path, window):
    """Steps 0.5 s apart: after the step that submits a cascade, no manager call is made
    for 0.47 s (the collecting round comes 0.43 s after the step). With the window the
    thread processes the cascade's result meanwhile, so no work is pending when the next
    step begins; with it off the result waits for a step."""
    e = engines(tmp_path, top={"tier_poll_window": window})
    m = e.manager
    period = 0.5
    for _ in range(3):  # the rhythm: three step ends, period apart
        with m.lock:
            m.on_schedule_end(END)
        time.sleep(period)
    _submitted_cascade(e)
    time.sleep(0.47)
    with m.lock:
        pending = m.has_pending_work()  # reads the manager's jobs; polls nothing
    if window:
        assert not pending, f"the cascade's result was not collected: {m.window_poll_rounds}"
        assert m.window_poll_rounds[0] > 0
    else:
        assert pending
        assert m.window_poll_rounds is None
    e.settle()


@pytest.mark.parametrize("value", [-0.1, 0.96, "x", True])
def test_a_bad_window_names_the_key_the_value_and_the_range(value):
    with pytest.raises(ConfigError) as err:
        TieringConfig.from_extra_config({"tier_poll_window": value})
    text = str(err.value)
    assert "['tier_poll_window']" in text and f"= {value!r} is invalid" in text
    assert "a share of the engine's step period, 0 (off) to 0.95" in text


def test_the_window_defaults_on_and_zero_turns_it_off():
    assert TieringConfig.from_extra_config({}).tier_poll_window == 0.85
    assert TieringConfig.from_extra_config({"tier_poll_window": 0}).tier_poll_window == 0.0


def test_rounds_failing_past_the_give_up_time_end_the_thread_and_say_so(window_thread, caplog,
                                                                        monkeypatch):
    from shmtier.scheduler.tiering import poll_thread
    monkeypatch.setattr(poll_thread, "POLL_GIVE_UP_AFTER_S", 0.1)
    eng = EngineThread(busy_s=0.001, forward_s=0.01)

    def poll():
        raise RuntimeError("tier broke")

    r = StepRhythm(0.8, 0.002)
    t = window_thread(eng.lock, poll, r)
    deadline = time.monotonic() + 10
    while t.is_alive():
        assert time.monotonic() < deadline, "the thread never gave up"
        eng.run(r, 1)
    assert "step-window poll thread stops after 0 s of failed rounds" in caplog.text
    assert not eng.lock.locked()


# --- what a step leaves to the rounds ---

def _rhythm(m, period: float = 0.1) -> None:
    """Steps ``period`` apart, as many as the thread's rhythm remembers (earlier steps,
    e.g. a settle loop's, no longer count); returns once a round ran after the last."""
    for _ in range(STEP_ENDS_KEPT):
        with m.lock:
            m.on_schedule_end(END)
        rounds = m.window_poll_rounds[0]
        time.sleep(period)
    assert m.window_poll_rounds[0] > rounds, "no round in the forward pass"


def _stored_in_step(e, keys, first_block, ctx) -> None:
    """``e.offload`` with the lock already held (no round can run in between)."""
    m = e.manager
    out = m.prepare_store(keys, ctx)
    e.copy("store", out.store_spec, [first_block + i for i in range(len(keys))])
    m.complete_store(out.keys_to_store, ctx)


def _evicted_from_the_cpu_tier(e, n: int) -> list:
    """``n`` keys stored by a finished request and cascaded, then evicted from the CPU
    tier (of 8 chunks) by 8 more keys; returns them."""
    first = [key(i) for i in range(n)]
    a = ReqContext("a")
    e.offload(first, 0, a)
    with e.manager.lock:
        e.manager.on_request_finished(a)
    e.settle()
    e.offload([key(100 + i) for i in range(8)], n, ReqContext("b"))
    e.settle()
    return first


def _tier_finishes(tier) -> list:
    """The request ids of the tier's ``on_request_finished`` calls from now on."""
    seen, real = [], tier.on_request_finished

    def finished(ctx):
        seen.append(ctx.req_id)
        return real(ctx)

    tier.on_request_finished = finished
    return seen


def test_keys_evicted_before_the_round_that_would_cascade_them_are_counted_lost(engines,
                                                                               tmp_path):
    """While rounds come, a step's stored keys wait unpinned for the next round; a store
    of the same step that needs their rows evicts them: the round skips them, counted
    lost, and cascades the rest."""
    from test_cascade_defer import counters, on_disk

    e = engines(tmp_path, chunks=4)
    e.settle()
    m = e.manager
    _rhythm(m)
    with m.lock:
        _stored_in_step(e, [key(1), key(2)], 0, ReqContext("a"))
        out = m.prepare_store([key(10 + i) for i in range(4)], ReqContext("b"))  # all rows
        assert m.primary.ready_keys([key(1), key(2)]) == []
        m.complete_store(out.keys_to_store, ReqContext("b"), success=False)
        m.on_schedule_end(END)
    e.settle()
    assert on_disk(tmp_path) == set()
    assert counters(e)[metrics.CASCADE_DEFERRED_LOST_CHUNKS] == 2


def _pool_submits(e) -> list:
    """(op, thread name) of every pool job the engine's tier sends from now on."""
    pool, seen = e.spec.worker_pool, []
    real = pool.submit

    def submit(op, *args, **kw):
        seen.append((op, threading.current_thread().name))
        return real(op, *args, **kw)

    pool.submit = submit
    return seen


def test_while_rounds_come_a_step_leaves_its_stores_to_the_next_round(engines, tmp_path):
    """A cascade queued in a step goes to the workers at the round after it, not in the
    step; a step after a forward pass without a round sends it itself."""
    e = engines(tmp_path, chunks=8)
    e.settle()  # the start-up listing done: nothing else in flight
    m = e.manager
    sent = _pool_submits(e)
    _rhythm(m)  # rounds come in the forward passes
    a = ReqContext("a")
    finished = _tier_finishes(m.tiers[0])
    with m.lock:
        _stored_in_step(e, [key(1), key(2)], 0, a)
        m.on_request_finished(a)
        m.on_schedule_end(END)
        assert sent == [], "the step sent its stores"
        # nothing pinned for them in the step, and the tier hears of the request's end
        # only after its cascade went
        assert [m.primary.is_evictable(k) for k in (key(1), key(2))] == [True, True]
        assert m.has_pending_work() and finished == []
    deadline = time.monotonic() + 0.09
    while not sent:  # the round after the step sends them
        assert time.monotonic() < deadline, "no round sent the stores"
        time.sleep(0.002)
    assert sent == [("store", "shmtier_step_window_poll")]
    assert finished == ["a"]
    with m.lock:  # two steps with no forward pass (no round) between them
        _stored_in_step(e, [key(3)], 2, ReqContext("b"))
        m.on_schedule_end(END)  # rounds came before this step: its store is left queued
        assert len(sent) == 1
        m.on_schedule_end(END)  # none since: this step sends it itself
        assert sent[1:] == [("store", threading.current_thread().name)]
    e.settle()


def test_while_rounds_come_a_step_still_sends_its_promotions(engines, tmp_path):
    """A request waits for a promotion: the step that reserves it sends it at once."""
    e = engines(tmp_path, chunks=8)
    first = _evicted_from_the_cpu_tier(e, 8)
    m = e.manager
    _rhythm(m)
    sent = _pool_submits(e)
    reader = ReqContext("r")
    with m.lock:
        assert m.lookup(first[0], reader) is PENDING
        m.on_schedule_end(END)
        assert ("load", threading.current_thread().name) in sent, "the promotion waits for a round"
    assert e.until_hit([first[0]], reader)


def test_while_rounds_come_the_rounds_forget_the_misses_past_their_ttl(engines, tmp_path):
    """A key the medium lacks is remembered as a miss for ``probe_ttl_s``; while rounds
    come, a step leaves forgetting it to them (a lookup checks the time itself), so the
    remembered misses stay bounded with no step at all."""
    e = engines(tmp_path, chunks=8, probe_ttl_s=0.05)
    e.settle()
    m = e.manager
    _rhythm(m)
    probes = m.tiers[0]._lookups
    reader = ReqContext("r")
    deadline = time.monotonic() + 20
    while True:  # RETRY until a probe answers: absent
        with m.lock:
            answer = m.lookup(key(7), reader)
            m.on_schedule_end(END)
        if answer.name == "MISS":
            break
        assert time.monotonic() < deadline, "the probe of an absent key never answered"
        time.sleep(0.01)
    assert key(7) in probes._missed
    deadline = time.monotonic() + 5
    while key(7) in probes._missed:  # no step from here on: only rounds run
        assert time.monotonic() < deadline, f"no round forgot the miss: {m.window_poll_rounds}"
        time.sleep(0.01)


def _engine_polls(tier) -> list:
    """A 1 for every ``get_finished_jobs`` of ``tier`` the engine (main) thread makes
    from now on."""
    polls = []
    real = tier.get_finished_jobs

    def spy():
        if threading.current_thread() is threading.main_thread():
            polls.append(1)
        return real()

    tier.get_finished_jobs = spy
    return polls


def test_after_a_round_that_left_nothing_in_flight_no_call_of_the_step_polls_the_tier(
        engines, tmp_path):
    """Lookups (one probing an unknown key) and stores of a step after a quiet round do
    not poll the storage tier: the step sends it nothing before its end."""
    e = engines(tmp_path, chunks=8)
    e.settle()
    m = e.manager
    polls = _engine_polls(m.tiers[0])
    _rhythm(m)
    assert m._rhythm.quiet
    polls.clear()
    with m.lock:
        assert m.lookup(key(50), ReqContext("r")).name == "RETRY"  # probed at the round
        _stored_in_step(e, [key(1), key(2)], 0, ReqContext("a"))
        _stored_in_step(e, [key(3)], 2, ReqContext("b"))
        m.on_schedule_end(END)
        assert polls == [], "a call of the step polled a tier with nothing in flight"
    e.settle()
    assert e.until_hit([key(1), key(2), key(3)], ReqContext("c"))


def test_while_rounds_come_a_step_polls_the_node_tier_for_its_loads_not_its_cascades(
        engines, tmp_path):
    """The node tier: a step leaves the results of cascades in flight to the rounds (it
    waits for none) and polls while a load is in flight; the chunk is a HIT."""
    import signal

    from test_fs_accounting import stop_workers

    e = engines(tmp_path, chunks=8, tier_type="node", size_bytes=1 << 20)
    first = _evicted_from_the_cpu_tier(e, 4)
    m, tier = e.manager, e.manager.tiers[0]
    _rhythm(m)
    sent, polls = _pool_submits(e), _engine_polls(tier)
    window = "shmtier_step_window_poll"
    pids = stop_workers(e, signal.SIGSTOP)  # what is sent stays in flight
    try:
        with m.lock:
            _stored_in_step(e, [key(200)], 12, ReqContext("c"))
            m.on_schedule_end(END)
            assert sent == []
        deadline = time.monotonic() + 5
        while ("store", window) not in sent:
            assert time.monotonic() < deadline, "no round sent the cascade"
            time.sleep(0.002)
        polls.clear()
        reader = ReqContext("r")
        with m.lock:  # a step after the round: only a cascade in flight
            assert m.lookup(first[0], reader) is PENDING
            m.prepare_store([key(201)], ReqContext("d"))
            assert polls == [], "the step polled for a cascade's result"
            assert not tier.step_needs_poll()
            m.on_schedule_end(END)  # the promotion's load goes now
            assert sent[1:] == [("load", threading.current_thread().name)]
        assert tier.step_needs_poll()
        with m.lock:
            assert m.lookup(first[0], reader) is PENDING  # the load with stopped workers
            assert polls == [1], "the step did not poll for its load"
            m.on_schedule_end(END)
    finally:
        stop_workers(e, signal.SIGCONT)
    assert pids
    assert e.until_hit([first[0]], reader)
    e.settle()


def test_a_step_after_a_round_that_left_nothing_in_flight_does_not_poll_the_tier(engines,
                                                                                  tmp_path):
    """Nothing in flight after the forward pass's round, and no call of the step polled:
    the step's end does not poll the storage tier (there is nothing to collect); a step
    with no round before it does."""
    e = engines(tmp_path, chunks=8)
    e.settle()
    m = e.manager
    engine_polls = _engine_polls(m.tiers[0])
    _rhythm(m)  # rounds came, and with the tier settled they left nothing in flight
    assert m._rhythm.quiet
    engine_polls.clear()  # (the rhythm's first steps polled)
    with m.lock:
        m.on_schedule_end(END)
        assert engine_polls == [], "the step polled a tier with nothing in flight"
        m.on_schedule_end(END)  # no round since the last step: it polls
        assert engine_polls == [1]
    e.settle()
