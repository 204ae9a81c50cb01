"""A tier worker's heartbeat while its job thread is inside a tier backend call.

Runs in: a tier worker process: one daemon thread (``shmtier-busy-beat``), started by the
job loop (``workers/job_loop.py``) once its backends are built, and the job thread, which
marks each backend call with :meth:`BusyBeat.enter` / :meth:`BusyBeat.leave` (or
:meth:`wrap`, :meth:`busy`). Never blocks the job thread: entering a call is two
attribute writes, plus an ``Event.set`` when the beat thread sleeps.

Why: the job loop beats between job slices, so a slice's time is the heartbeat's gap.
A slice that waits on I/O the worker was asked to do (an object store answering each GET
in 3 s, within its ``read_timeout_s``) took longer than the pool's heartbeat timeout
(2 s) and the pool killed the worker as hung, failing the promotion it was serving.
How long one request may take is bounded by the backend's own timeouts and, whatever
they are, by the part deadline (``tier_job_timeout_s``), which the pool enforces apart
from the heartbeat. The heartbeat says only whether the worker still runs.

The rule::

    job thread inside a backend call   this thread beats every interval
    job thread anywhere else           this thread sleeps (no wake-ups); the job loop
                                       beats itself, between slices and at each wake-up

What each hang looks like to the pool (``shmtier/scheduler/pool/``):

* stopped (SIGSTOP), or frozen as a whole: no thread runs, no beats: hung at the
  heartbeat timeout, as before;
* the job loop stuck outside a backend call (a deadlock in the loop, a ring wait): no
  beats: hung at the heartbeat timeout;
* a backend call that never returns (a request without a timeout, a deadlock inside the
  backend): beats go on; the part deadline kills it;
* the job thread holding the GIL in one long C call: this thread cannot run, beats are
  late; the pool's late-beat judge (``late_beats.py``) spares a worker that is running,
  and the part deadline still applies.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class BusyBeat:
    """Beats ``beat()`` every ``interval_s`` while a backend call is in progress (see
    the module docstring). One per worker process; :meth:`stop` ends its thread."""

    def __init__(self, beat: Callable[[], None], interval_s: float):
        if not interval_s > 0:
            raise ValueError(f"busy beat interval_s={interval_s!r}: must be > 0")
        self._beat = beat
        self._interval_s = interval_s
        self._depth = 0  # backend calls in progress (written by the job thread only)
        self._wake = threading.Event()  # set while the beat thread should be awake
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmtier-busy-beat",
                                        daemon=True)
        self._thread.start()

    def enter(self) -> None:
        """The job thread starts a backend call."""
        self._depth += 1
        if not self._wake.is_set():
            self._wake.set()

    def leave(self) -> None:
        """The job thread's backend call returned (or raised)."""
        self._depth -= 1

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """``with busy_beat.busy():`` around a backend call (or a listing's iteration)."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` marked as a backend call each time it is called."""
        def call(*args, **kwargs):
            self.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()
        return call

    def stop(self, timeout_s: float = 1.0) -> None:
        """End the beat thread and wait (at most ``timeout_s``) until it has: no beat
        comes after this returns (the job thread is in no backend call then)."""
        self._stopped.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait()
            if self._stopped.wait(self._interval_s):
                return
            if self._depth:
                self._beat()
                continue
            self._wake.clear()  # no call in progress: sleep until the next one
            if self._depth:  # one began between the check and the clear
                self._wake.set()
