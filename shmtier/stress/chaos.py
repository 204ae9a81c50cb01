"""What the stress run does to the tiers while its trace plays (``Chaos``), and the runner
that does it (``ChaosRunner``).

Who calls: the run's scheduler thread, between manager calls (``tick`` before each request
and each deferred step); nothing here waits on a tier worker. Faults and what each counts
(``ChaosRunner.counts``; all of it goes into the verdict):

* ``kill_every_s``: SIGKILL a random healthy tier worker (the pool restarts it); and one at
  each of ``kill_worker_at`` (as soon as a worker is healthy), so a short run kills too.
* ``delete_namespace_at`` / ``delete_root_at``: remove everything under the fs root, or the
  root itself (made again ``root_gone_s`` later).
* ``corrupt_at``: damage ``corrupt_files`` random chunk files (flip payload bytes, cut the
  file, overwrite its header; ``faults.CORRUPTIONS`` in turn); each damaged file is
  remembered by path and inode for the end's accounting.
* ``fill_root_at``: the fs root lives on a small tmpfs mounted for the run; a filler file
  beside the root takes all its free space (stores meet ENOSPC) for ``fill_for`` of the
  trace, then is removed. Without the mount the fault is skipped, with the reason. Bytes
  cascaded after the free count from the free, or from the root's return when it was
  removed (``delete_root_at``) before the free; not at all when it came back only as the
  trace ended (``root_back_at_end``: the run does not judge that check then).
* ``stall_at``: SIGSTOP a random healthy tier worker for ``stall_s`` (longer than the pool's
  heartbeat timeout, so a stalled worker that holds jobs is killed as hung), then SIGCONT;
  the manager calls made meanwhile are timed apart.
* ``warm_restart_at``: the scheduler process is SIGKILLed there and a new one re-attaches
  to its segment (``shmtier/stress/restart.py``; the run does it, not this runner).
* ``big_file_at``: replace ``big_files`` random chunk files by sparse files over 4 GiB
  (``faults.plant_big``; never one already damaged), each remembered by path and inode:
  the tier must take each for a foreign file (a MISS, removed), never fail its neighbours,
  and none may be left once a fresh engine listed the root.
* ``namespace_link_at``: move the namespace directory beside the root and put a symbolic
  link to it in its place, then SIGKILL a healthy tier worker (at the next tick that finds
  one), so that its replacement starts with the link there; until it beat each step waits
  ``LINK_PAUSE_S``. After ``link_for`` of the trace, once that replacement beat (or the
  pool broke, or ``LINK_WAIT_S`` passed), remove the link and move the directory back; if
  it has not beaten by then the trace stops there and idles the engine until it has (an
  operator waits for the restart before undoing the link), so that the rest of the trace
  is left to store. Bytes cascaded after that count (``written_after_link``); the
  replacement becoming healthy counts (``link_replacements_healthy``).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Callable

from shmtier.shared import procinfo
from shmtier.stress import faults

WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
#: The most the runner waits, past ``link_for``, for the worker killed under a namespace
#: link to be replaced before it removes the link.
LINK_WAIT_S = 15.0
#: Meanwhile each step of the trace waits this long (the pool starts the replacement in
#: the manager's calls between steps): a short trace does not end before it.
LINK_PAUSE_S = 0.05


@dataclass(frozen=True)
class Chaos:
    """What ``run_stress`` does to the tiers while the trace plays (module docstring).
    Fractions are of the trace's requests."""

    kill_every_s: float | None = None  # mean seconds between SIGKILLs of a tier worker
    delete_namespace_at: tuple[float, ...] = ()  # rm -r root/*
    delete_root_at: tuple[float, ...] = ()  # rm -r root ...
    root_gone_s: float = 1.0  # ... and mkdir root this many seconds later
    corrupt_at: tuple[float, ...] = ()  # damage chunk files ...
    corrupt_files: int = 4  # ... this many each time
    fill_root_at: float | None = None  # fill the root's (tmpfs) filesystem ...
    fill_for: float = 0.15  # ... for this fraction of the trace
    tmpfs_bytes: int | None = None  # the tmpfs' size (None: the working set's bytes + 16 MiB)
    stall_at: tuple[float, ...] = ()  # SIGSTOP a tier worker ...
    stall_s: float = 3.0  # ... for this long, then SIGCONT
    warm_restart_at: float | None = None  # kill the scheduler here; warm restart
    # a SIGKILL of a tier worker at these fractions, whatever kill_every_s's clock says
    kill_worker_at: tuple[float, ...] = ()
    big_file_at: tuple[float, ...] = ()  # replace chunk files by sparse 5 GiB files ...
    big_files: int = 1  # ... this many each time
    namespace_link_at: tuple[float, ...] = ()  # the namespace directory becomes a link ...
    link_for: float = 0.1  # ... for this fraction of the trace (a worker restarts meanwhile)

    def __post_init__(self) -> None:
        for name in ("kill_worker_at", "delete_namespace_at", "delete_root_at", "corrupt_at",
                     "stall_at", "fill_root_at", "warm_restart_at", "big_file_at",
                     "namespace_link_at"):
            value = getattr(self, name)
            for f in (value if isinstance(value, tuple) else () if value is None else (value,)):
                if not 0 <= f < 1:
                    raise ValueError(f"Chaos.{name} = {value!r}: fractions of the trace must "
                                     f"be in [0, 1)")
        if self.fill_root_at is not None and not 0 < self.fill_for < 1 - self.fill_root_at:
            raise ValueError(f"Chaos.fill_for = {self.fill_for!r}: must be > 0 and end before "
                             f"the trace does (fill_root_at = {self.fill_root_at})")
        if self.corrupt_files < 1:
            raise ValueError(f"Chaos.corrupt_files = {self.corrupt_files!r}: must be >= 1")
        if self.big_files < 1:
            raise ValueError(f"Chaos.big_files = {self.big_files!r}: must be >= 1")
        for at in self.namespace_link_at:
            if not 0 < self.link_for < 1 - at:
                raise ValueError(f"Chaos.link_for = {self.link_for!r}: must be > 0 and end "
                                 f"before the trace does (namespace_link_at = {at})")
        if self.stall_s <= 0 or self.root_gone_s < 0:
            raise ValueError(f"Chaos.stall_s = {self.stall_s!r}, root_gone_s = "
                             f"{self.root_gone_s!r}: must be > 0 and >= 0")

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Chaos":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


class ChaosRunner:
    """Applies a ``Chaos`` to one engine (one scheduler process's part of the trace:
    requests ``first`` to ``last``, of ``requests``)."""

    def __init__(self, chaos: Chaos, rng, pool, engine_id: str, root: str, requests: int,
                 counters: dict, timer, first: int = 0, last: int | None = None,
                 filler: str | None = None, namespace: str | None = None,
                 idle_step: Callable[[], object] | None = None):
        """``namespace``: the name of the engine's namespace directory under ``root``
        (for ``namespace_link_at``; None: the one found there at the time). ``idle_step``:
        one engine step with no request (the pool restarts workers in the manager's calls),
        taken while the trace waits for the worker killed under the namespace link to be
        replaced; None: the wait only sleeps."""
        self.chaos, self.rng, self.pool, self.engine_id, self.root = (
            chaos, rng, pool, engine_id, root)
        self.namespace = namespace
        self.counters, self.timer, self.filler = counters, timer, filler
        self.idle_step = idle_step
        last = requests if last is None else last
        at = lambda fs, what: [(int(f * requests), what) for f in fs  # noqa: E731
                               if first <= int(f * requests) < last]
        fill = () if chaos.fill_root_at is None or filler is None else (chaos.fill_root_at,)
        free = () if not fill else (chaos.fill_root_at + chaos.fill_for,)
        unlink = tuple(f + chaos.link_for for f in chaos.namespace_link_at)
        self.events = sorted(at(chaos.delete_namespace_at, "namespace")
                             + at(chaos.delete_root_at, "root") + at(chaos.corrupt_at, "corrupt")
                             + at(fill, "fill") + at(free, "free") + at(chaos.stall_at, "stall")
                             + at(chaos.kill_worker_at, "kill") + at(chaos.big_file_at, "big")
                             + at(chaos.namespace_link_at, "link") + at(unlink, "unlink"))
        self.kills_waiting = 0
        self.kill_at = self._next_kill(time.monotonic())
        self.recreate_at: float | None = None
        self.stalled: tuple | None = None  # (pid, until, hung before, calls window)
        self.stalls_waiting = 0
        self.filled = False
        self.written_at_free: float | None = None
        # freed while the root was gone: stores can work only once the root is back
        self._free_waits_for_root = False
        #: The root was gone at the free and came back only at ``stop``: whether stores
        #: resume after the free cannot be judged (nothing is left to store).
        self.root_back_at_end = False
        self.counts = {"kills": 0, "no_worker_to_kill": 0, "namespace_deletions": 0,
                       "root_deletions": 0, "files_deleted": 0, "rm_retries": 0,
                       "corrupt_events": 0, "stalls": 0, "stalls_resumed": 0,
                       "stalls_killed_as_hung": 0, "stall_max_call_ms": 0.0, "fills": 0,
                       "filled_bytes": 0, "written_after_free": 0,
                       "big_file_events": 0, "big_files_planted": 0, "namespace_links": 0,
                       "namespace_links_skipped": 0, "namespace_links_removed": 0,
                       "namespace_dirs_put_back": 0, "link_kills": 0,
                       "link_replacements_healthy": 0, "link_pool_broken": 0,
                       "written_after_link": 0,
                       **{f"corrupted_{how}": 0 for how in faults.CORRUPTIONS}}
        self.corrupted: list[list] = []  # [path, faults.identity, how]
        self.big: list[list] = []  # [path, faults.identity] of the files plant_big made
        #: the namespace link in place: (namespace path, aside path, (slot, pid) killed
        #: under it, None, or "replaced" once its replacement beat (or the pool broke),
        #: when to give up waiting for it: None until ``link_for`` is over)
        self.linked: tuple | None = None
        self.written_at_unlink: float | None = None
        #: The link was still in place when the trace ended (removed only by ``stop``):
        #: whether stores resume after it cannot be judged.
        self.link_removed_at_end = False

    def _next_kill(self, now: float) -> float:
        every = self.chaos.kill_every_s
        return now + every * self.rng.uniform(0.5, 1.5) if every else math.inf

    def tick(self, request_no: int) -> None:
        now = time.monotonic()
        if self.recreate_at is not None and now >= self.recreate_at:
            self._recreate_root()
        if self.stalled is not None and now >= self.stalled[1]:
            self._resume()
        if self.linked is not None:
            if self.linked[2] is None:  # none was healthy at the link: kill one now
                self._kill_under_link()
            replaced = self._replaced_or_late(now)
            if replaced and self.linked[3] is not None:  # and link_for is over
                self._restore_namespace()
            elif not replaced:  # the operator waits for the restart: so does the trace,
                time.sleep(LINK_PAUSE_S)  # a little per step
        while self.events and self.events[0][0] <= request_no:
            what = self.events.pop(0)[1]
            if what == "stall":
                self.stalls_waiting += 1
            elif what == "kill":  # a run shorter than kill_every_s still kills
                self.kills_waiting += 1
            else:
                getattr(self, f"_{what}")()
        if self.stalls_waiting and self.stalled is None and self._stall():
            self.stalls_waiting -= 1
        if self.kills_waiting and self._kill():
            self.kills_waiting -= 1
        if now >= self.kill_at:
            self.kill_at = self._next_kill(now) if self._kill() else now + 0.05

    def stop(self) -> None:
        """No more chaos: the root exists again, a stalled worker runs, the filler is gone,
        no more kills."""
        self.kill_at = math.inf
        self.events = [e for e in self.events if e[1] == "free"]
        self.stalls_waiting = self.kills_waiting = 0
        if self.linked is not None:
            self._restore_namespace()
            self.link_removed_at_end = True
        if self.recreate_at is not None:
            self._recreate_root(at_end=True)
        if self.stalled is not None:
            self._resume()
        if self.filled:
            self._free()
        if self.written_at_free is not None:
            self.counts["written_after_free"] = (self.counters.get(WRITE_BYTES, 0)
                                                 - self.written_at_free)
        self.note_written()

    def note_written(self) -> None:
        """Count the bytes cascaded since the namespace link was removed (again at the end
        of the run: the settling's cascades count too)."""
        if self.written_at_unlink is not None:
            self.counts["written_after_link"] = (self.counters.get(WRITE_BYTES, 0)
                                                 - self.written_at_unlink)

    # --- tier workers ---

    def _healthy_worker(self) -> tuple[int, int] | None:
        """A random healthy tier worker's ``(slot, pid)``, or None."""
        live = self.pool.healthy_workers() if self.pool is not None else []
        if not live:
            return None
        slot, pid = live[int(self.rng.integers(len(live)))]
        # the pool's record names our own child: check its command line anyway
        return (slot, pid) if procinfo.is_tier_worker(pid, self.engine_id) else None

    def _kill(self) -> bool:
        return self._kill_one() is not None

    def _kill_one(self) -> tuple[int, int] | None:
        """SIGKILL a random healthy tier worker (not a stalled one): its ``(slot, pid)``."""
        worker = self._healthy_worker()
        slot, pid = worker if worker is not None else (None, None)
        if pid is None or (self.stalled is not None and pid == self.stalled[0]):
            self.counts["no_worker_to_kill"] += pid is None
            return None
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            return None
        self.counts["kills"] += 1
        return slot, pid

    def _stall(self) -> bool:
        worker = self._healthy_worker()
        if worker is None:
            return False
        pid = worker[1]
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError:
            return False
        window: list[float] = []
        self.timer.windows.append(window)
        self.stalled = (pid, time.monotonic() + self.chaos.stall_s, self.pool.hung_total, window)
        self.counts["stalls"] += 1
        return True

    def _resume(self) -> None:
        pid, _, hung_before, window = self.stalled
        self.stalled = None
        self.timer.windows.remove(window)
        if window:
            self.counts["stall_max_call_ms"] = max(self.counts["stall_max_call_ms"],
                                                   max(window) * 1e3)
        if procinfo.is_tier_worker(pid, self.engine_id):
            try:
                os.kill(pid, signal.SIGCONT)
                self.counts["stalls_resumed"] += 1
                return
            except OSError:
                pass
        # gone: the pool's health check judged it hung (no heartbeat) and killed it
        self.counts["stalls_killed_as_hung"] += self.pool.hung_total > hung_before

    # --- files ---

    def _corrupt(self) -> None:
        self.counts["corrupt_events"] += 1
        done = {c[0] for c in self.corrupted} | {b[0] for b in self.big}
        files = [p for p in faults.chunk_files(self.root) if p not in done]
        n = min(self.chaos.corrupt_files, len(files))
        for i in self.rng.choice(len(files), n, replace=False).tolist() if n else []:
            how = faults.CORRUPTIONS[len(self.corrupted) % len(faults.CORRUPTIONS)]
            ident = faults.corrupt(files[i], how, self.rng)
            if ident is not None:
                self.counts[f"corrupted_{how}"] += 1
                self.corrupted.append([files[i], ident, how])

    def _big(self) -> None:
        self.counts["big_file_events"] += 1
        done = {c[0] for c in self.corrupted} | {b[0] for b in self.big}
        files = [p for p in faults.chunk_files(self.root) if p not in done]
        n = min(self.chaos.big_files, len(files))
        for i in self.rng.choice(len(files), n, replace=False).tolist() if n else []:
            ident = faults.plant_big(files[i])
            if ident is not None:
                self.counts["big_files_planted"] += 1
                self.big.append([files[i], ident])

    def _namespace_path(self) -> str | None:
        if self.namespace is not None:
            return os.path.join(self.root, self.namespace)
        from shmtier.storage.chunk_names import is_namespace_name

        try:
            names = [n for n in os.listdir(self.root) if is_namespace_name(n)]
        except OSError:
            return None
        return os.path.join(self.root, names[0]) if names else None

    def _link(self) -> None:
        ns = self._namespace_path()
        aside = os.path.join(os.path.dirname(self.root), "namespace-aside")
        if self.linked is not None or ns is None or not faults.link_namespace(ns, aside):
            self.counts["namespace_links_skipped"] += 1
            return
        self.counts["namespace_links"] += 1
        self.linked = (ns, aside, None, None)
        self._kill_under_link()

    def _kill_under_link(self) -> None:
        """SIGKILL a healthy tier worker while the link is in place (its replacement starts
        with the link there); when none is healthy now, the next ticks try again."""
        killed = self._kill_one()
        if killed is not None:
            self.counts["link_kills"] += 1
            ns, aside, _, give_up = self.linked
            self.linked = (ns, aside, killed, give_up)

    def _unlink(self) -> None:
        """``link_for`` is over: remove the link once the worker killed under it has been
        replaced (``_replaced_or_late``), at the latest ``LINK_WAIT_S`` from now. The trace
        waits here meanwhile: were it to play on, a slow restart (a loaded host) could take
        the rest of the trace (or of the first scheduler's part, before a warm restart) and
        leave nothing to store once the link is gone."""
        if self.linked is None:
            return
        ns, aside, killed, _ = self.linked
        self.linked = (ns, aside, killed, time.monotonic() + LINK_WAIT_S)
        while not self._replaced_or_late(time.monotonic()):
            if self.linked[2] is None:  # none was healthy at the link: kill one now
                self._kill_under_link()
            if self.idle_step is not None:
                self.idle_step()
            time.sleep(LINK_PAUSE_S)
        self._restore_namespace()

    def _replaced_or_late(self, now: float) -> bool:
        """Whether the worker killed under the link has a healthy replacement (counted
        once), the pool broke (counted), or ``LINK_WAIT_S`` passed since ``link_for``
        ended (none could be killed, or its replacement never beat)."""
        ns, aside, killed, give_up = self.linked
        if killed == "replaced":
            return True
        if self.pool.broken is not None:
            self.counts["link_pool_broken"] += 1
            self.linked = (ns, aside, "replaced", give_up)
            return True
        if killed is not None and any(slot == killed[0] and pid != killed[1]
                                      for slot, pid in self.pool.healthy_workers()):
            self.counts["link_replacements_healthy"] += 1
            self.linked = (ns, aside, "replaced", give_up)
            return True
        return give_up is not None and now >= give_up

    def _restore_namespace(self) -> None:
        ns, aside, _, _ = self.linked
        self.linked = None
        self.counts["namespace_links_removed"] += 1
        self.counts["namespace_dirs_put_back"] += faults.unlink_namespace(ns, aside)
        self.written_at_unlink = self.counters.get(WRITE_BYTES, 0)

    def _fill(self) -> None:
        self.counts["fills"] += 1
        self.counts["filled_bytes"] += faults.fill(self.filler)
        self.filled = True

    def _free(self) -> None:
        if not self.filled:
            return
        os.unlink(self.filler)
        self.filled = False
        if self.recreate_at is not None:  # the root is gone: counted from its return
            self._free_waits_for_root = True
        else:
            self.written_at_free = self.counters.get(WRITE_BYTES, 0)

    def _namespace(self) -> None:
        self._count_files()
        self.counts["namespace_deletions"] += 1
        # rm -r racing the workers' writes can leave a directory (ENOTEMPTY): then the
        # namespace is still the same directory, with files gone under it, which the
        # tier does not detect (see bench/README.md). Remove it as an operator would,
        # again until it is gone.
        for attempt in range(20):
            for name in os.listdir(self.root):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            if not os.listdir(self.root):
                break
            self.counts["rm_retries"] += 1

    def _root(self) -> None:
        self._count_files()
        self.counts["root_deletions"] += 1
        for attempt in range(20):
            shutil.rmtree(self.root, ignore_errors=True)
            if not os.path.exists(self.root):
                break
            self.counts["rm_retries"] += 1
        self.recreate_at = time.monotonic() + self.chaos.root_gone_s

    def _count_files(self) -> None:
        self.counts["files_deleted"] += len(faults.chunk_files(self.root))

    def _recreate_root(self, at_end: bool = False) -> None:
        self.recreate_at = None
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        if self._free_waits_for_root:
            self._free_waits_for_root = False
            if at_end:
                self.root_back_at_end = True
            else:
                self.written_at_free = self.counters.get(WRITE_BYTES, 0)


def merge_counts(a: dict, b: dict) -> dict:
    """Two runners' counts (two scheduler processes of one run) as one."""
    out = dict(a)
    for k, v in b.items():
        out[k] = max(out.get(k, 0), v) if k.endswith("_max_call_ms") else out.get(k, 0) + v
    return out


def report(counts: dict) -> str:
    """The chaos line of ``shmtier run``'s output."""
    c = counts
    corrupted = sum(c[f"corrupted_{h}"] for h in faults.CORRUPTIONS)
    none = c["no_worker_to_kill"]
    line = (f"chaos: {c['kills']} tier workers SIGKILLed"
            f"{f' ({none} times none was healthy)' if none else ''}, "
            f"namespace deleted {c['namespace_deletions']}x, root deleted and recreated "
            f"{c['root_deletions']}x ({c['files_deleted']} chunk files deleted, rm -r "
            f"repeated {c['rm_retries']}x)")
    if c["corrupt_events"]:
        line += (f"; {corrupted} chunk files damaged ("
                 + ", ".join(f"{c[f'corrupted_{h}']} {h}" for h in faults.CORRUPTIONS) + ")")
    if c["stalls"]:
        line += (f"; {c['stalls']} tier workers stalled (SIGSTOP): {c['stalls_resumed']} "
                 f"resumed, {c['stalls_killed_as_hung']} killed as hung by the pool")
    if c["fills"]:
        line += f"; root filled {c['fills']}x ({c['filled_bytes']} filler bytes)"
    if c["big_file_events"]:
        line += f"; {c['big_files_planted']} chunk files replaced by sparse 5 GiB files"
    if c["namespace_links"] or c["namespace_links_skipped"]:
        line += (f"; namespace replaced by a symlink {c['namespace_links']}x "
                 f"({c['namespace_links_skipped']} skipped; {c['link_kills']} workers "
                 f"SIGKILLed under it, {c['link_replacements_healthy']} replacements healthy, "
                 f"pool broken {c['link_pool_broken']}x; directory put back "
                 f"{c['namespace_dirs_put_back']}x)")
    return line
