"""The connector driver: vLLM's OffloadingConnector scheduler half, as everything in
shmtier that stands in for vLLM calls a manager: the stress run (shmtier/stress/engine.py),
the bench (shmtier/bench/driver.py), the demo, the test engines (tests/fs_engine.py,
tests/p2p_engine.py) and bench/p2p_tier.py. It is the one place that knows the call order
(docs/vllm-contract.md §2.2-2.3, vLLM 0.34's ``v1/offloading/scheduler.py``); nothing runs
it under vLLM, which calls the manager itself.

Who calls: the process that plays the scheduler, on its one scheduler thread; a driver
is not shared between threads. No torch, no vLLM: the manager's value types come from
the manager's side (``contract``: shmtier's by default, vLLM's for vLLM's managers).

The lock. A manager may run threads of its own that take ``manager.lock`` (shmtier's
tier-poll and step-window threads), so the driver holds it where vLLM 0.33+'s connector
does: one *step region* for a step's lookups, ``prepare_load``, ``get_load_source``,
``prepare_store``, ``on_request_finished`` and ``on_schedule_end`` (a HIT must still be
there when ``prepare_load`` pins it), and *short regions* for ``on_new_request``, the
completions (``update_connector_output``), ``has_pending_work``, ``get_stats`` and
``take_events``. The lock is not reentrant. Two layers:

* **calls** (``new_request``, ``scan``, ``lookup_each``, ``load_sources``,
  ``prepare_load``, ``prepare_store``, ``complete_load``, ``complete_store``, ``finish``,
  ``end_step``, ``has_pending_work``, ``get_stats``, ``take_events``): one manager call,
  or one lookup scan, each. The caller holds ``locked()``. They block only as long as the
  manager does.
* **sequences** (``open``, ``close``, ``step``, ``step_until``, ``look_step``, ``until``,
  ``complete``, ``store``, ``load``, ``play``, ``complete_jobs``, ``engine_hooks``,
  ``settle``): take the lock themselves, the caller must not hold it. The copies between
  arena rows and GPU blocks (the GPU workers' part) run outside the lock, through a copy
  function the caller gives, and may block; ``step_until``, ``until`` and ``settle``
  sleep between steps, ``play`` waits as its ``on_deferred`` hook does.

Timing. Each call is a timed region on the calling thread: the clocks (``perf_counter_ns``
wall, ``thread_time_ns`` on-CPU) are read right around the manager call, the lookup scan's
loop or the lock's acquisition (kind ``LOCK_WAIT``), with nothing of the driver's inside.
A :class:`Meter` given to the driver is told of each (the bench's figures, the stress
run's latency bound, the demo's table, the p2p engine's slowest call); without one the
clocks are not read.

Not replayed: sliding-window and partial-tail lookups, EAGLE's extra chunk, sync loads,
preemption flushes, ``reset_cache`` (no caller needs them).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from shmtier import contract as shmtier_contract

__all__ = ["ConnectorDriver", "Meter", "Lookup", "Played", "Hooks", "Contract", "LOCK_WAIT",
           "request_context"]

#: the kind of the region that waits for ``manager.lock``
LOCK_WAIT = "lock wait"


class Contract(NamedTuple):
    """The value types a manager speaks: shmtier's (``SHMTIER``) or vLLM's."""

    LookupResult: type
    ReqContext: type
    ScheduleEndContext: type


SHMTIER = Contract(shmtier_contract.LookupResult, shmtier_contract.ReqContext,
                   shmtier_contract.ScheduleEndContext)


class Meter:
    """Told of each timed region a driver runs (module docstring); this base keeps nothing.

    Called on the driver's thread; ``end`` must not call the driver."""

    def begin(self) -> Any:
        """Before a region's clocks are read; what it returns is ``end``'s ``token``."""
        return None

    def end(self, token: Any, kind: str, calls: int, keys: int, wall_ns: int, cpu_ns: int) -> None:
        """After the region's clocks are read: ``calls`` manager calls of ``kind`` (a scan:
        its lookups; ``LOCK_WAIT``: 1) handling ``keys`` keys (a call's key list, else 1)
        took ``wall_ns`` of wall time and ``cpu_ns`` of this thread's CPU."""


def request_context(req_context: type, req_id: str, keys=(), tokens_per_chunk: int = 16,
                    params: dict | None = None):
    """A new ``req_context`` (shmtier's or vLLM's ``ReqContext``) with ``params`` as its
    ``kv_transfer_params`` and each key's end-token position set as the connector sets it:
    chunk i ends at token (i+1) x ``tokens_per_chunk`` (none for no ``keys``)."""
    ctx = (req_context(req_id=req_id) if params is None
           else req_context(req_id=req_id, kv_transfer_params=params))
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * tokens_per_chunk)
    return ctx


def _nothing(*_args) -> None:
    return None


def _listed(fn):
    return list(fn())


class _Held:
    """``driver.locked()``: ``manager.lock`` held, the wait for it a timed region."""

    __slots__ = ("_d",)

    def __init__(self, driver: ConnectorDriver):
        self._d = driver

    def __enter__(self):
        d = self._d
        lock, tt, pc = d._lock, d._tt, d._pc
        token = d._begin()
        c0 = tt()
        w0 = pc()
        lock.__enter__()
        w1 = pc()
        c1 = tt()
        d._end(token, LOCK_WAIT, 1, 1, w1 - w0, c1 - c0)

    def __exit__(self, *exc):
        self._d._lock.__exit__(None, None, None)


@dataclass(eq=False)
class Lookup:
    """A request whose keys a step looks up (``look_step``, ``until``): ``answers``, one
    list per step; once final, the keys it loads (``hits``, the leading HITs),
    ``prepare_load``'s spec (``load``), their ``sources`` and ``prepare_store``'s output
    for ``offer`` (``store``; None: refused)."""

    keys: list
    ctx: Any
    offer: list | None = None  # keys prepare_store gets when final (None: no store)
    answers: list = field(default_factory=list)
    final: bool = False
    hits: list = field(default_factory=list)
    load: Any = None
    sources: list = field(default_factory=list)
    store: Any = None


@dataclass
class Played:
    """What ``play`` did with one request."""

    ctx: Any
    answers: list  # the final lookup scan's
    hits: list  # the keys loaded
    sources: list  # their get_load_source answers
    store: Any  # prepare_store's output (None: refused)
    deferred_steps: int


class Hooks(NamedTuple):
    """What the engine's per-step hooks returned."""

    pending: bool
    stats: Any
    events: list


class ConnectorDriver:
    """Calls ``manager`` as vLLM's connector does (module docstring).

    ``contract``: the manager's value types (shmtier's by default). ``connector``: how the
    replayed vLLM line hands a job's keys to the completions and calls ``complete_store``
    (shmtier/bench/baseline.py's ``Connector``); None: the keys as given, ``complete_store
    (keys, ctx)``. ``meter``: told of each timed region (None: none timed).
    ``tokens_per_chunk``: a request's chunk i ends at token (i+1) x this."""

    def __init__(self, manager, *, contract: Contract = SHMTIER, connector=None,
                 meter: Meter | None = None, tokens_per_chunk: int = 16):
        self.manager = manager
        self._m = manager
        self._lock = manager.lock
        self._held = _Held(self)
        self.contract = contract
        LR = contract.LookupResult
        self.HIT, self.MISS, self.PENDING, self.RETRY = LR.HIT, LR.MISS, LR.HIT_PENDING, LR.RETRY
        self.job_keys = connector.job_keys if connector is not None else (lambda keys: keys)
        self._completer = connector.store_completer(manager) if connector is not None else None
        self.tokens_per_chunk = tokens_per_chunk
        self.measure(meter)

    def measure(self, meter: Meter | None) -> None:
        """Tell ``meter`` of the regions from now on (None: time none)."""
        if meter is None:
            self._begin, self._end, self._pc, self._tt = _nothing, _nothing, int, int
        else:
            self._begin, self._end = meter.begin, meter.end
            self._pc, self._tt = time.perf_counter_ns, time.thread_time_ns

    @contextmanager
    def unmeasured(self):
        """``with driver.unmeasured():`` the calls made inside are timed by no meter (an
        idle settling between a run's measured steps); the meter comes back after."""
        saved = self._begin, self._end, self._pc, self._tt
        self.measure(None)
        try:
            yield self
        finally:
            self._begin, self._end, self._pc, self._tt = saved

    # ------------------------------------------------------------------ answers

    def deferred(self, answers) -> bool:
        """Whether vLLM's connector defers the request (a HIT_PENDING or RETRY answer)."""
        return any(a is self.PENDING or a is self.RETRY for a in answers)

    def leading_hits(self, answers) -> int:
        """How many answers from the first are HIT."""
        n, hit = 0, self.HIT
        for a in answers:
            if a is not hit:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ calls (lock held)

    def locked(self) -> _Held:
        """``with driver.locked():`` holds ``manager.lock``, its wait timed as ``LOCK_WAIT``."""
        return self._held

    def _call(self, kind: str, fn, *args):
        tt, pc = self._tt, self._pc
        token = self._begin()
        c0 = tt()
        w0 = pc()
        out = fn(*args)
        w1 = pc()
        c1 = tt()
        keys = len(args[0]) if args and isinstance(args[0], (list, tuple, set)) else 1
        self._end(token, kind, 1, keys, w1 - w0, c1 - c0)
        return out

    def new_request(self, req_id: str, keys=(), params: dict | None = None):
        """``on_new_request`` for a new context (``request_context``); returns the context."""
        ctx = request_context(self.contract.ReqContext, req_id, keys, self.tokens_per_chunk, params)
        self._call("on_new_request", self._m.on_new_request, ctx)
        return ctx

    def scan(self, keys, ctx, start: int = 0) -> list:
        """vLLM's lookup scan of a request's full-attention chunks: ``lookup`` for each key
        from ``keys[start]`` until the first MISS (included); one timed region. The
        request is deferred if an answer is HIT_PENDING or RETRY (``deferred``); else its
        hits are its HIT answers."""
        lookup, miss, n = self._m.lookup, self.MISS, len(keys)
        tt, pc = self._tt, self._pc
        answers = []
        token = self._begin()
        c0 = tt()
        w0 = pc()
        for i in range(start, n):
            r = lookup(keys[i], ctx)
            answers.append(r)
            if r is miss:
                break
        w1 = pc()
        c1 = tt()
        self._end(token, "lookup", len(answers), len(answers), w1 - w0, c1 - c0)
        return answers

    def lookup_each(self, keys, ctx) -> list:
        """Every key's ``lookup`` answer (not vLLM's scan, which stops at a MISS: a test
        asking for each key's state); one timed region."""
        lookup = self._m.lookup
        tt, pc = self._tt, self._pc
        token = self._begin()
        c0 = tt()
        w0 = pc()
        answers = [lookup(k, ctx) for k in keys]
        w1 = pc()
        c1 = tt()
        self._end(token, "lookup", len(answers), len(answers), w1 - w0, c1 - c0)
        return answers

    def load_sources(self, keys, ctx) -> list:
        """``get_load_source`` of each key (after its ``prepare_load``); one timed region."""
        m = self._m
        tt, pc = self._tt, self._pc
        token = self._begin()
        c0 = tt()
        w0 = pc()
        sources = [m.get_load_source(k, ctx) for k in keys]
        w1 = pc()
        c1 = tt()
        self._end(token, "get_load_source", len(keys), len(keys), w1 - w0, c1 - c0)
        return sources

    def prepare_load(self, keys, ctx):
        return self._call("prepare_load", self._m.prepare_load, keys, ctx)

    def prepare_store(self, keys, ctx):
        return self._call("prepare_store", self._m.prepare_store, keys, ctx)

    def complete_load(self, keys, ctx) -> None:
        self._call("complete_load", self._m.complete_load, keys, ctx)

    def complete_store(self, keys, ctx) -> None:
        """``complete_store`` as the replayed connector calls it (``connector``)."""
        self._call("complete_store", self._completer or self._m.complete_store, keys, ctx)

    def finish(self, ctx) -> None:
        """``on_request_finished`` (after the request's last ``prepare_store``)."""
        self._call("on_request_finished", self._m.on_request_finished, ctx)

    def end_step(self, new_req_ids=(), preempted_req_ids=()) -> None:
        """``on_schedule_end``: the step region's last call."""
        self._call("on_schedule_end", self._m.on_schedule_end,
                   self.contract.ScheduleEndContext(new_req_ids, preempted_req_ids))

    def has_pending_work(self) -> bool:
        return self._call("has_pending_work", self._m.has_pending_work)

    def get_stats(self):
        return self._call("get_stats", self._m.get_stats)

    def take_events(self) -> list:
        return self._call("take_events", _listed, self._m.take_events)

    # ------------------------------------------------------------------ sequences (lock free)

    def open(self, req_id: str, keys=(), params: dict | None = None):
        """A request arrives: ``new_request`` in a short region; returns its context."""
        with self._held:
            return self.new_request(req_id, keys, params)

    def close(self, ctx) -> None:
        """A request finishes: ``on_request_finished`` and ``on_schedule_end`` in one step
        region (the end of ``build_connector_meta``)."""
        with self._held:
            self.finish(ctx)
            self.end_step()

    def step(self, new_req_ids=(), preempted_req_ids=()) -> None:
        """A step with nothing else to do: ``on_schedule_end``."""
        with self._held:
            self.end_step(new_req_ids, preempted_req_ids)

    def step_until(self, cond: Callable[[], Any], *, timeout_s: float,
                   sleep_s: float = 0.005) -> bool:
        """Steps with nothing else to do (``step``), sleeping ``sleep_s`` after each, until
        ``cond()`` (asked before each step, without the lock) is true; False if
        ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() >= deadline:
                return False
            self.step()
            time.sleep(sleep_s)
        return True

    def look_step(self, reqs: list[Lookup], *, scan: bool = False, load: bool = False,
                  sources: bool = False,
                  done: Callable[[list], bool] | None = None) -> list[Lookup]:
        """One step region: each request of ``reqs`` not yet final looks its keys up
        (``scan``: vLLM's scan, else ``lookup_each``); one whose answers are final (``done``;
        default: not deferred) gets, with ``load``, ``prepare_load`` of its leading HITs
        (and, with ``sources``, their ``load_sources``), then ``prepare_store`` of its
        ``offer``; ``on_schedule_end`` last. Returns the requests final in this step."""
        done = done or (lambda answers: not self.deferred(answers))
        now = []
        with self._held:
            for r in reqs:
                if r.final:
                    continue
                answers = self.scan(r.keys, r.ctx) if scan else self.lookup_each(r.keys, r.ctx)
                r.answers.append(answers)
                if not done(answers):
                    continue
                r.final = True
                now.append(r)
                hits = self.leading_hits(answers) if load else 0
                if hits:
                    r.hits = list(r.keys[:hits])
                    r.load = self.prepare_load(r.hits, r.ctx)
                    if sources:
                        r.sources = self.load_sources(r.hits, r.ctx)
                if r.offer is not None:
                    r.store = self.prepare_store(r.offer, r.ctx)
            self.end_step()
        return now

    def until(self, reqs: list[Lookup], *, timeout_s: float, sleep_s: float = 0.005,
              before_step: Callable[[], Any] | None = None, **step) -> bool:
        """``look_step`` once per step (``step``: its options), ``before_step()`` ahead of
        each, sleeping ``sleep_s`` between, until every request is final; False if
        ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while True:
            if before_step is not None:
                before_step()
            self.look_step(reqs, **step)
            if all(r.final for r in reqs):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(sleep_s)

    def store(self, keys, ctx, copy: Callable[[Any], Any]):
        """The store path: ``prepare_store`` (step region); ``copy(out)``, the GPU blocks
        into the rows it gave (only when it gave keys); ``complete_store`` (short region).
        Returns ``prepare_store``'s output (None: refused, nothing copied)."""
        with self._held:
            out = self.prepare_store(keys, ctx)
        if out is not None and out.keys_to_store:
            copy(out)
            with self._held:
                self.complete_store(self.job_keys(out.keys_to_store), ctx)
        return out

    def load(self, keys, ctx, copy: Callable[[Any], Any], *, finish: bool = False):
        """The load path for ``keys`` (all HIT): ``prepare_load`` (step region);
        ``copy(spec)``, the rows into GPU blocks; ``complete_load`` (and, with ``finish``,
        ``on_request_finished``) in a short region. Returns the spec."""
        with self._held:
            spec = self.prepare_load(keys, ctx)
        copy(spec)
        with self._held:
            self.complete_load(self.job_keys(keys), ctx)
            if finish:
                self.finish(ctx)
        return spec

    def complete_jobs(self, jobs) -> None:
        """``update_connector_output``: ``complete_store`` / ``complete_load`` of each
        finished job ``(is_store, keys, ctx)`` (keys as ``job_keys`` made them), in one
        short region."""
        with self._held:
            for is_store, keys, ctx in jobs:
                if is_store:
                    self.complete_store(keys, ctx)
                else:
                    self.complete_load(keys, ctx)

    def complete(self, req: Lookup, copy_load: Callable[[Any, list], Any] | None = None,
                 copy_store: Callable[[Any], Any] | None = None) -> None:
        """What follows a request's final ``look_step``, outside the lock: ``copy_load(spec,
        hit_keys)`` when it loads, ``copy_store(out)`` when ``prepare_store`` gave keys
        (the GPU workers' part); then ``complete_load`` / ``complete_store`` in one short
        region (``update_connector_output``)."""
        out = req.store
        stored = out is not None and out.keys_to_store
        if req.hits and copy_load is not None:
            copy_load(req.load, req.hits)
        if stored and copy_store is not None:
            copy_store(out)
        jobs = ([(False, self.job_keys(req.hits), req.ctx)] if req.hits else []) + (
            [(True, self.job_keys(out.keys_to_store), req.ctx)] if stored else [])
        if jobs:
            self.complete_jobs(jobs)

    def play(self, req_id: str, keys, *, known: int | None = None, offer=None,
             copy_load: Callable[[Any, list], Any] | None = None,
             copy_store: Callable[[Any], Any] | None = None,
             on_deferred: Callable[[], Any] | None = None) -> Played:
        """One request's life, alone in the engine: it arrives (``open``, positions from
        ``keys``); each step looks ``keys[:known]`` up (vLLM's scan; default all) until
        not deferred, calling ``on_deferred()`` after each deferred step; in the final
        step's region its leading HITs are loaded (``prepare_load``, ``load_sources``) and
        ``offer`` (default: ``keys``; empty: no store) offered to ``prepare_store``; then
        the copies and completions (``complete``); it finishes (``close``)."""
        ctx = self.open(req_id, keys)
        known = len(keys) if known is None else known
        offer = list(keys) if offer is None else list(offer)
        r = Lookup(list(keys[:known]), ctx, offer or None)
        deferred_steps = 0
        while not self.look_step([r], scan=True, load=True, sources=True):
            deferred_steps += 1
            if on_deferred is not None:
                on_deferred()
        self.complete(r, copy_load, copy_store)
        self.close(ctx)
        return Played(ctx, r.answers[-1], r.hits, r.sources, r.store, deferred_steps)

    def engine_hooks(self) -> Hooks:
        """The engine's hooks after a step, each in its own short region:
        ``has_pending_work``, ``get_stats``, ``take_events``."""
        with self._held:
            pending = self.has_pending_work()
        with self._held:
            stats = self.get_stats()
        with self._held:
            events = self.take_events()
        return Hooks(pending, stats, events)

    def settle(self, timeout_s: float, *, sleep_s: float = 0.005,
               stats: Callable[[Any], Any] | None = None) -> int | None:
        """Idle engine steps until the manager has no pending work: per step
        ``on_schedule_end`` and ``has_pending_work`` (and, given ``stats``, ``get_stats``,
        its payload handed to ``stats``) in one region, sleeping ``sleep_s`` between.
        Returns the steps it took (the last found nothing pending), None if ``timeout_s``
        passed first."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        while True:
            with self._held:
                self.end_step()
                pending = self.has_pending_work()
                payload = self.get_stats() if stats is not None else None
            steps += 1
            if stats is not None:
                stats(payload)
            if not pending:
                return steps
            if time.monotonic() >= deadline:
                return None
            time.sleep(sleep_s)
