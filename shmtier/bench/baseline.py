"""The vLLM baseline of the benches: which vLLM is installed and how its offloading
connector calls a manager, as far as the driver replays it. The one place in the bench
where vLLM 0.33 and 0.34 differ: the driver (shmtier/bench/driver.py), the managers and
the reports ask the :class:`Connector` this module picks, never a version.

Who calls: ``shmtier bench`` (shmtier/bench/run.py) and bench/tiering_steps.py call
:func:`load` once, in their own process, before the first run; it imports vLLM
(seconds) only when the vLLM baseline is requested. Everything else reads what it
loaded (:func:`connector`, :func:`label`). Uses vLLM's own classes, never shmtier's
vLLM adapter (shmtier.vllm).

The line is told by vLLM's interfaces, not its version string: 0.34 has no
``OffloadingManager.touch`` and its ``ReqContext`` declares the request's token
counts; 0.33 has ``touch`` and ``OffloadingManager.lock``. A vLLM that fits neither
(0.32 has no ``manager.lock``, which the driver holds as both connectors do) is refused
with what it lacks.

What the two connectors do differently on the path the driver replays
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``):

* the keys a finished job hands to ``complete_store`` / ``complete_load``: 0.33 a
  ``set`` of them (so its order is the set's), 0.34 a tuple in prefix order without
  repeats (:meth:`Connector.job_keys`);
* ``complete_store``: 0.34 passes ``success=`` (True: the bench's copies never fail),
  0.33 the keys and the context only (:meth:`Connector.store_completer`).

Not replayed, because no manager the bench runs reads it: 0.34's ``ReqContext`` token
counts (``num_computed_tokens`` and the like; in vLLM only the kvcr tier reads them).
The other 0.33 -> 0.34 changes are inside vLLM's managers, which the bench runs as they
are: ``touch`` is gone (neither connector calls it; 0.33 already records recency when a
request finishes), the fs tier marks a key it stored present in its lookup cache,
``JobResult.deferred_release`` (only the p2p tier sets it), the tier-poll thread's
back-off and ``has_pending_work`` leaving out what that thread finishes (polled tiers
only: p2p, not fs), the CPU manager's ``store_threshold`` counting (the tiering spec
refuses a threshold, and the bench sets none).

Without vLLM (not importable, or not requested) the calls are replayed as the newest
line's connector makes them.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass

__all__ = ["Connector", "UnsupportedVllm", "LINES", "NEWEST", "load", "connector", "label",
           "detect", "saved_baseline"]


class UnsupportedVllm(RuntimeError):
    """The installed vLLM fits none of the connector lines the bench replays."""


@dataclass(frozen=True)
class Connector:
    """How one vLLM release line's offloading connector calls a manager, where the
    driver's replay depends on it, and which vLLM was loaded."""

    line: str  # "0.33", "0.34": the release line whose connector is replayed
    ordered_job_keys: bool  # complete_* get the keys in prefix order (else a set)
    store_success_kwarg: bool  # complete_store(keys, ctx, success=True)
    vllm_version: str | None = None  # vllm.__version__ when loaded, else None

    def job_keys(self, keys):
        """The collection of ``keys`` (a job's, in prefix order) that this connector
        keeps for the job and later hands to ``complete_store`` / ``complete_load``."""
        return tuple(dict.fromkeys(keys)) if self.ordered_job_keys else set(keys)

    def store_completer(self, manager):
        """``manager.complete_store`` called as this connector calls it, with
        ``(keys, req_context)``."""
        if self.store_success_kwarg:
            return functools.partial(manager.complete_store, success=True)
        return manager.complete_store

    @property
    def baseline(self) -> str | None:
        """What the vLLM baseline is, e.g. "vLLM 0.34.0 TieringOffloadingSpec"; None
        when vLLM was not loaded."""
        if self.vllm_version is None:
            return None
        return f"vLLM {self.vllm_version} TieringOffloadingSpec"

    @property
    def replay(self) -> str:
        """How the driver calls the managers, for the reports."""
        how = f"calls as vLLM {self.line}'s OffloadingConnector makes them"
        return how if self.vllm_version is not None else how + " (no vLLM loaded)"

    def as_dict(self) -> dict:
        return {"baseline": self.baseline, "vllm_version": self.vllm_version,
                "connector_line": self.line, "replay": self.replay,
                "job_keys": "tuple in prefix order" if self.ordered_job_keys else "set",
                "complete_store_success_kwarg": self.store_success_kwarg}


#: the lines, newest first
LINES = (Connector("0.34", ordered_job_keys=True, store_success_kwarg=True),
         Connector("0.33", ordered_job_keys=False, store_success_kwarg=False))
NEWEST = LINES[0]


def _declares(cls, name: str) -> bool:
    return inspect.getattr_static(cls, name, None) is not None


def detect(manager_cls, req_context_cls, version: str) -> Connector:
    """The line of a vLLM whose ``OffloadingManager`` and ``ReqContext`` are given
    (``version`` is only reported). Raises UnsupportedVllm naming, per line, what the
    installed vLLM lacks or has that the line does not."""
    needs = {
        "0.34": [("OffloadingManager.lock", _declares(manager_cls, "lock")),
                 ("no OffloadingManager.touch", not _declares(manager_cls, "touch")),
                 ("ReqContext.num_computed_tokens",
                  _declares(req_context_cls, "num_computed_tokens"))],
        "0.33": [("OffloadingManager.lock", _declares(manager_cls, "lock")),
                 ("OffloadingManager.touch", _declares(manager_cls, "touch"))],
    }
    for line in LINES:
        if all(ok for _, ok in needs[line.line]):
            return Connector(line.line, line.ordered_job_keys, line.store_success_kwarg,
                             version)
    missing = "; ".join(f"{line.line} needs " + ", ".join(w for w, ok in needs[line.line] if not ok)
                        for line in LINES)
    raise UnsupportedVllm(f"vLLM {version}: the bench replays the offloading connector of vLLM "
                          f"{' or '.join(line.line for line in LINES)}, and this vLLM fits "
                          f"neither ({missing})")


_loaded: Connector = NEWEST


def load(want_vllm: bool) -> tuple[Connector, str]:
    """Import vLLM when ``want_vllm`` and pick its connector line; returns the connector
    the runs replay (also what :func:`connector` returns from now on) and a note for the
    report (the version, the import time, whether its fs tier has the fs_io_C
    extension, or why vLLM is not measured: not importable, or a vLLM that fits no line).
    Without vLLM: :data:`NEWEST`."""
    global _loaded
    _loaded = NEWEST
    if not want_vllm:
        return _loaded, "vLLM not requested"
    t0 = time.perf_counter()
    try:
        import vllm
        import vllm.v1.kv_offload.tiering.manager  # noqa: F401 - fail here, not mid-run
        from vllm.v1.kv_offload.base import OffloadingManager, ReqContext

        found = detect(OffloadingManager, ReqContext, vllm.__version__)
    except UnsupportedVllm as e:
        return _loaded, f"vLLM NOT measured ({e}): shmtier measured alone"
    except Exception as e:  # noqa: BLE001 - any import failure: shmtier alone
        return _loaded, f"vLLM NOT importable ({type(e).__name__}: {e}): shmtier measured alone"
    _loaded = found
    note = (f"{found.baseline} imported in {time.perf_counter() - t0:.1f} s (not timed); "
            f"driver {found.replay}")
    try:
        import vllm.fs_io_C  # noqa: F401
        note += "; its fs tier uses the fs_io_C extension"
    except Exception as e:  # noqa: BLE001
        note += (f"; fs_io_C not importable ({type(e).__name__}), so its fs tier runs its "
                 "pure-Python I/O path")
    return found, note


def connector() -> Connector:
    """The connector :func:`load` picked (:data:`NEWEST` before it ran or without vLLM)."""
    return _loaded


def label() -> str:
    """The vLLM baseline's column label: "vLLM 0.34.0" once loaded, else "vLLM"."""
    v = _loaded.vllm_version
    return f"vLLM {v}" if v else "vLLM"


def saved_baseline(data: dict) -> str:
    """The vLLM baseline a saved bench JSON ran against: its ``baseline`` entry, or for a
    file written before there was one, the version its vLLM note names (those benches
    ran vLLM 0.33)."""
    base = data.get("baseline")
    if isinstance(base, dict) and base.get("baseline"):
        return base["baseline"]
    note = str(data.get("vllm", ""))
    if note.startswith("vLLM ") and " imported" in note:
        return f"vLLM {note.split()[1]} TieringOffloadingSpec"
    return "vLLM (version not recorded)"
