"""The p2p tier's metrics: their names and definitions, the per-peer label rule, and the
endpoint's running totals turned into counter increases (:class:`P2PMetrics`).

Runs in: the scheduler process, called by the tier's scheduler half (``scheduler.py``)
under the tiering manager's lock. Never blocks; no I/O.

Per-peer series carry the label ``peer``: the other engine's "host:port" (``"inbound"``
for refusals at this engine's own server), the first ``MAX_PEER_LABELS`` peers by name,
later ones together as ``"other"``.
"""

from __future__ import annotations

from typing import Any

from shmtier import metrics
from shmtier.tiers.p2p.channel import Counters

LOOKUPS = "vllm:kv_offload_shmtier_p2p_lookups"
LOOKUP_HITS = "vllm:kv_offload_shmtier_p2p_lookup_hits"
FETCHED_BYTES = "vllm:kv_offload_shmtier_p2p_fetched_bytes"
SERVED_BYTES = "vllm:kv_offload_shmtier_p2p_served_bytes"
FETCH_SECONDS = "vllm:kv_offload_shmtier_p2p_fetch_seconds"
REFUSED = "vllm:kv_offload_shmtier_p2p_refused_handshakes"
REFUSED_REQUESTS = "vllm:kv_offload_shmtier_p2p_refused_requests"
FAILURES = "vllm:kv_offload_shmtier_p2p_failures"
UNBOUND_TIMEOUTS = "vllm:kv_offload_shmtier_p2p_unbound_store_timeouts"
PARKED_ROWS = "vllm:kv_offload_shmtier_p2p_parked_rows"
RESTARTS = "vllm:kv_offload_shmtier_p2p_endpoint_restarts"
PEER = "peer"  # label: the peer's "host:port" (MAX_PEER_LABELS of them, then "other")
MAX_PEER_LABELS = 64
INBOUND = "inbound"  # the peer label of refusals at this engine's own server


def metric_definitions() -> dict[str, Any]:
    """The tier's metrics (its ``build_metric_definitions``)."""
    t, tp = (metrics.TIER,), (metrics.TIER, PEER)
    c = metrics.CounterMetadata
    return {
        LOOKUPS: c("Keys this engine asked a peer about (symmetric lookups).", tp),
        LOOKUP_HITS: c("Keys a peer answered it holds.", tp),
        FETCHED_BYTES: c("Chunk bytes fetched from a peer (verified).", tp),
        SERVED_BYTES: c("Chunk bytes served to a peer (by the name its hello gave).", tp),
        FETCH_SECONDS: c("Seconds of fetch rounds (promotions from a peer).", tp),
        REFUSED: c("Handshakes refused (unknown key, other layout or hash seed): by a "
                   "peer, or at this engine's server (peer=\"inbound\"); and requests "
                   "naming a peer without a known key.", tp),
        REFUSED_REQUESTS: c("Fetches, lookups and dones of an admitted peer naming a "
                            "request bound to another peer (nothing served; "
                            "peer=\"inbound\").", tp),
        FAILURES: c("Fetch rounds and lookups that failed, per peer.", tp),
        UNBOUND_TIMEOUTS: c("Parked requests released by unbound_store_timeout_s.", t),
        PARKED_ROWS: metrics.GaugeMetadata("Primary rows pinned for peers.", t),
        RESTARTS: c("Endpoint process restarts.", t),
        **metrics.deferred_release_metric_definitions(),
    }


class P2PMetrics:
    """One p2p tier's counters since the last ``take``, labelled ``label`` ("1:p2p")."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._stats = metrics.OffloadingStats()
        self._peer_labels: set[str] = set()
        self._counters_seen: dict = {}
        self.endpoint_counters: dict = {}  # the endpoint's last running totals, as sent

    def peer(self, peer: str) -> tuple[str, str]:
        """The labels of a per-peer series (see the module docstring)."""
        if peer not in self._peer_labels:
            if len(self._peer_labels) >= MAX_PEER_LABELS:
                return (self._label, "other")
            self._peer_labels.add(peer)
        return (self._label, peer)

    def count(self, name: str, n: float, peer: str) -> None:
        """Increase the per-peer counter ``name`` by ``n``."""
        self._stats.increase_counter(name, n, self.peer(peer))

    def count_tier(self, name: str, n: float = 1) -> None:
        """Increase the tier's counter ``name`` (no peer label) by ``n``."""
        self._stats.increase_counter(name, n, (self._label,))

    def count_failure(self, peer: str) -> None:
        self._stats.increase_counter(FAILURES, 1, self.peer(peer))

    def endpoint_restarted(self) -> None:
        """A new endpoint counts from 0."""
        self._counters_seen = {}

    def take_counters(self, msg: Counters) -> None:
        """The endpoint's running totals (its ``channel.Counters`` message, every second)
        as counter increases, per peer."""
        self.endpoint_counters = {"server": msg.server, "clients": msg.clients,
                                  "served": msg.served}
        now = {(REFUSED, INBOUND): sum(msg.server["refused_handshakes"].values()),
               (REFUSED_REQUESTS, INBOUND): msg.server.get("refused_requests", 0)}
        for name, n in msg.served.items():
            now[(SERVED_BYTES, name)] = n
        for peer, c in msg.clients.items():
            now[(FETCHED_BYTES, peer)] = c["bytes_received"]
            now[(REFUSED, peer)] = sum(c["refused_handshakes"].values())
        for (name, peer), value in now.items():
            seen = self._counters_seen.get((name, peer), 0)
            if value > seen:
                self._stats.increase_counter(name, value - seen, self.peer(peer))
            self._counters_seen[(name, peer)] = value

    def take(self, parked_rows: int) -> metrics.OffloadingStats:
        """What was counted since the last call, with the parked rows' gauge; starts anew."""
        stats, self._stats = self._stats, metrics.OffloadingStats()
        stats.set_gauge(PARKED_ROWS, parked_rows, (self._label,))
        return stats
