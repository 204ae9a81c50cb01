"""``--busy N``: a busy host for the benches: N processes spinning at niceness 0.

Runs in: the bench's process (``shmtier bench``, bench/tiering_steps.py). ``BusyHost`` is
a context manager the bench enters before its first run and leaves after its last, also
when a run fails or the bench is told to stop (``common.exit_through_finally`` unwinds
through it), so every manager (shmtier and vLLM's own tiering) runs on the same busy host.

Each spinner is a fresh interpreter (``python -c``, never a fork of the bench, which holds
segments and threads) that sets its niceness to 0 (absolute: a bench started under
``nice`` cannot lower it again, and then ``describe`` says what the spinners got), says
so on its stdout, and spins; it exits by itself once its parent is gone (it checks
``getppid`` every few ms), so a SIGKILLed bench leaves none behind. This stands in for
what a serving host also runs at the engine's priority: tokenizers, the API server,
other pods (issue 29).
"""

from __future__ import annotations

import os
import subprocess
import sys

# A spinner: SCHED_OTHER at niceness 0 if it can, report its niceness, spin until the
# parent is gone.
_SPIN = """\
import os, sys
parent = int(sys.argv[1])
for set_it in (lambda: os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0)),
               lambda: os.setpriority(os.PRIO_PROCESS, 0, 0)):
    try:
        set_it()
    except OSError:
        pass
print(os.getpriority(os.PRIO_PROCESS, 0), flush=True)
while os.getppid() == parent:
    for _ in range(100000):
        pass
"""


class BusyHost:
    """``n`` spinning processes while entered (none for ``n`` = 0). ``niceness``: what
    each one got (read from its first line, so every spinner runs once ``__enter__``
    returns)."""

    def __init__(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"--busy {n!r}: expected a number of processes >= 0")
        self.n = n
        self.procs: list[subprocess.Popen] = []
        self.niceness: list[int] = []

    def __enter__(self) -> "BusyHost":
        try:
            for _ in range(self.n):
                proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid())],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        text=True)
                self.procs.append(proc)
                line = proc.stdout.readline()
                if not line.strip().lstrip("-").isdigit():
                    raise RuntimeError(f"a --busy spinner did not start (it said {line!r})")
                self.niceness.append(int(line))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Kill and reap every spinner (idempotent)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = []

    def describe(self) -> str:
        """The busy host in words, for the method line."""
        if not self.n:
            return "busy host: none (no --busy)"
        got = sorted(set(self.niceness))
        nice = ("niceness 0" if got == [0] else
                f"niceness {', '.join(map(str, got))} (0 refused: the bench runs niced)")
        return (f"busy host: {self.n} process{'es' if self.n > 1 else ''} spinning at {nice}, "
                f"SCHED_OTHER, started before the first run and stopped after the last "
                f"(--busy {self.n}; the same for every manager)")

    def as_dict(self) -> dict:
        return {"processes": self.n, "niceness": list(self.niceness)}
