"""What the benchmarks share: interleaving, the figures (percentiles, median [min-max]),
exiting through ``finally`` on a signal, writing the JSON, and the connector's view
of a request (its ``ReqContext`` and the driver's state for it).

Used by ``shmtier bench`` and by the scripts in bench/ (``python -m bench.<name>``).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
from dataclasses import dataclass

__all__ = ["rotated", "exit_through_finally", "join_or_kill", "write_json", "pct", "med_range", "fmt_mr",
           "DrivenRequest", "request_context"]


def rotated(items: list, repeat: int) -> list:
    """``items`` in the order of repeat ``repeat``: rotated by one per repeat, so no
    configuration always runs first (or right after the same one)."""
    k = repeat % len(items)
    return items[k:] + items[:k]


def exit_through_finally(signals=(signal.SIGTERM, signal.SIGHUP)) -> None:
    """On ``signals``, exit with 128 + the signal number through the ``finally``
    blocks, so a killed bench still removes its segments, files and directories."""
    for sig in signals:
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))


def join_or_kill(procs, timeout_s: float) -> None:
    """Join each of ``procs`` (``multiprocessing.Process``), waiting up to ``timeout_s``
    for each to exit after it was told to stop; kill and reap one that does not."""
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()


def write_json(path: str, data, **dump_kwargs) -> None:
    """``data`` as indented JSON at ``path`` (its directory made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, **dump_kwargs)


def pct(values, q):
    """Nearest-rank percentile (q in 0..100); None for an empty sequence."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def med_range(values):
    """(median, min, max) of the values that are not None; None if there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def fmt_mr(mr, digits=2, *, collapse=False) -> str:
    """A ``med_range`` as ``median [min-max]`` ("-" for None); with ``collapse``, just
    the median where min == max."""
    if mr is None:
        return "-"
    m, lo, hi = mr
    if collapse and lo == hi:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


# --------------------------------------------------------------------------- the connector's side


@dataclass(slots=True)
class DrivenRequest:
    """A request as a driver standing in for the connector's scheduler half keeps it:
    ``spec`` (the workload's request: keys, GPU-cached chunks, decode steps), its
    ``ReqContext`` once seen, the next chunk to offer for storing, whether it waits
    on a load, and the decode steps left before it finishes."""

    spec: object
    ctx: object = None
    cursor: int = 0
    waiting_load: bool = False
    decode_left: int = 0

    def admit(self, hits: int) -> list:
        """The request runs, its lookup scan having found ``hits`` chunks after the
        GPU-cached ones, capped so that one chunk is computed. Returns the keys to load
        first (none for no hits); the request then offers the chunks after them, or,
        without a load, all its chunks from the first (prepare_store filters what is
        present, the GPU-cached chunks included)."""
        spec = self.spec
        g = spec.gpu_cached
        hits = min(hits, len(spec.keys) - 1 - g)
        self.decode_left = spec.decode_steps
        if hits <= 0:
            self.cursor = 0
            return []
        self.waiting_load = True
        self.cursor = g + hits
        return list(spec.keys[g:g + hits])

    def next_action(self) -> str:
        """What the request does in this step's build_connector_meta: "wait" (for its
        load), "offer" (its next chunks to prepare_store, from ``cursor``), "decode"
        (a step without new chunks) or "finish" (on_request_finished)."""
        if self.waiting_load:
            return "wait"
        if self.cursor < len(self.spec.keys):
            return "offer"
        if self.decode_left > 0:
            self.decode_left -= 1
            return "decode"
        return "finish"


def request_context(req_context: type, req_id: str, keys, tokens_per_chunk: int):
    """A ``req_context`` (shmtier's or vLLM's ReqContext) for ``keys`` with their
    positions set as the connector sets them: chunk i ends at token (i+1) x
    ``tokens_per_chunk``."""
    ctx = req_context(req_id=req_id)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * tokens_per_chunk)
    return ctx
