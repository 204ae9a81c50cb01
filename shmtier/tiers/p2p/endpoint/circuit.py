"""Per-peer circuit breaker of the ``p2p`` tier: after a failure, fail fast until a backoff expires.

Runs in: the p2p endpoint process, which gives each peer's
:class:`~shmtier.tiers.p2p.endpoint.client.ChunkClient` one (its main thread reads the
state for the status file). Pure bookkeeping on a monotonic clock: never blocks, no I/O,
not thread-safe (one per client, used from the client's thread).

States: *closed* (calls go through), *open* (calls fail at once until ``retry_at``), and
after the backoff one trial call goes through (*half-open*): its success closes the circuit
and resets the backoff; its failure opens it again for twice as long, up to ``cap_s``.
The defaults follow vLLM's p2p reconnect backoff (contract §10.4: first retry after 1 s,
then doubling to 60 s).
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["PeerCircuit"]


class PeerCircuit:
    """Failure bookkeeping of one peer.

    ``base_s``: the backoff after the first failure; each failure in a row doubles it, up
    to ``cap_s``. ``clock``: seconds, monotonic (a test passes a fake one).

    Use: ``if not circuit.allow(): fail fast``; after the call ``record_success()`` or
    ``record_failure()``.
    """

    def __init__(self, base_s: float = 1.0, cap_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if not base_s > 0 or not cap_s >= base_s:
            raise ValueError(f"PeerCircuit: need 0 < base_s <= cap_s, got base_s={base_s!r}, "
                             f"cap_s={cap_s!r}")
        self.base_s = float(base_s)
        self.cap_s = float(cap_s)
        self._clock = clock
        self.failures = 0          # failures in a row (0: closed)
        self.retry_at = 0.0        # clock time before which allow() is False
        self.fast_failures = 0     # calls refused by allow() since construction

    @property
    def backoff_s(self) -> float:
        """The backoff the current run of failures set (0 when closed)."""
        if not self.failures:
            return 0.0
        return min(self.cap_s, self.base_s * 2.0 ** (self.failures - 1))

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` (failing fast) or ``"half-open"`` (next call is a trial)."""
        if not self.failures:
            return "closed"
        return "open" if self._clock() < self.retry_at else "half-open"

    def retry_in(self) -> float:
        """Seconds until a call goes through again (0 when it would now)."""
        return max(0.0, self.retry_at - self._clock()) if self.failures else 0.0

    def allow(self) -> bool:
        """True if a call may go to the peer now; False (counted) while the circuit is open."""
        if self.failures and self._clock() < self.retry_at:
            self.fast_failures += 1
            return False
        return True

    def record_success(self) -> None:
        """The peer answered: close the circuit and reset the backoff."""
        self.failures = 0
        self.retry_at = 0.0

    def record_failure(self) -> None:
        """The peer failed (timeout, gone, refused): open the circuit for the next backoff."""
        self.failures += 1
        self.retry_at = self._clock() + self.backoff_s

    def __repr__(self) -> str:
        return (f"PeerCircuit({self.state}, failures={self.failures}, "
                f"retry_in={self.retry_in():.3f}s)")
