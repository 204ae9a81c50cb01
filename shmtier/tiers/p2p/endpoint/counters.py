"""Counters of one p2p transport endpoint (a ChunkServer or a ChunkClient).

Runs in: the p2p endpoint process that owns the server or client; plain integers updated
by that one thread, read by whoever reports them (``as_dict``: the process's ``counters``
message to the scheduler half and its status file; tests). No locking, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["TransportCounters"]


@dataclass
class TransportCounters:
    """What one endpoint did. Server and client count the same things from their side.

    ``requests``: fetch requests (server: received from admitted peers; client: sent).
    ``lookups``: lookup requests, likewise. ``handshakes``: hellos accepted (server) or
    sessions opened (client). ``chunks``: chunks sent (server) or received and verified
    (client). ``misses``: keys answered "not here". ``bytes_sent`` / ``bytes_received``:
    chunk payload bytes (control frames not counted). ``checksum_failures``: chunks whose
    CRC-32C did not match (client; each one a CORRUPT outcome). ``timeouts``: client
    calls that ran out of time; on the server, peers whose outbound queue stalled past
    its limit and was dropped. ``errors``: other failures (peer gone, provider raised,
    malformed messages). ``fast_failures``: client calls refused by the open circuit
    without touching the network. ``refused_handshakes``: reason -> count; server
    reasons: ``unknown_key`` (CurveZMQ client key not in the allow-list, refused by the
    ZAP handler), ``handshake_crypto`` / ``handshake_mechanism`` / ``handshake_protocol``
    / ``handshake`` (the Curve handshake itself failed: e.g. the client expects another
    server key, or speaks plaintext), ``fingerprint``, ``hash_seed``, ``version`` (the
    hello did not match), ``no_hello`` (a request before any hello); client reasons: the
    peer's refusal reason, or ``auth`` / ``handshake`` as the client's socket saw them.
    ``refused_requests`` (server): fetches, lookups and dones of an admitted peer naming
    a request bound to another peer (``ChunkServer``'s ``request_owner``); nothing served.
    """

    requests: int = 0
    lookups: int = 0
    handshakes: int = 0
    chunks: int = 0
    misses: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    checksum_failures: int = 0
    timeouts: int = 0
    errors: int = 0
    fast_failures: int = 0
    refused_requests: int = 0
    refused_handshakes: dict[str, int] = field(default_factory=dict)

    def refuse(self, reason: str) -> None:
        """Count one refused handshake or hello for ``reason``."""
        self.refused_handshakes[reason] = self.refused_handshakes.get(reason, 0) + 1

    @property
    def refused(self) -> int:
        """All refused handshakes and hellos together."""
        return sum(self.refused_handshakes.values())

    def as_dict(self) -> dict:
        """A plain dict (copy) of every counter, for results, metrics and tests."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["refused_handshakes"] = dict(self.refused_handshakes)
        return d
