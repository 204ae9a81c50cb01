"""Options every storage tier takes (any process): ``fs`` and ``obj`` configs extend
:class:`StorageTierConfig`, which the storage scheduler half reads
(``shmtier/tiers/storage/scheduler.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from shmtier.options import boolean, choice_upper, integer, number
from shmtier.tiers.config import TierConfig, option

DEFAULT_PROBE_TTL_S = 0.25
DEFAULT_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True, kw_only=True)
class StorageTierConfig(TierConfig):
    """``max_bytes``: bytes the tier keeps on its medium at most (None: unbounded), at
    least one chunk's frame. ``locality``: "LOCAL" or "REMOTE" (request filters,
    backpressure defaults). ``enable_kv_events``: stored/evicted events for this tier.
    ``max_pinned_fraction``: at most this share of the CPU tier's rows may wait for this
    tier's cascades (more are dropped and counted as backpressure).

    Sharing the medium with other engines: ``probe_unknown`` (default true): a key the
    tier's index does not know is looked for on the medium by a worker (RETRY until
    the answer; false: the medium is this engine's alone, such a key is a MISS at
    once). ``probe_ttl_s``: a key found absent answers MISS without a new probe until
    no lookup asked for it for this long. ``probe_timeout_s``: a probe not answered by
    then answers MISS."""

    max_bytes: int | None = option(None, integer(1).or_none("null (unbounded)"), worker=True)
    locality: str | None = option(None, choice_upper("LOCAL", "REMOTE").or_none())
    enable_kv_events: bool = option(False, boolean())
    max_pinned_fraction: float = option(0.5, number(0, 1, min_open=True))
    probe_unknown: bool = option(True, boolean())
    probe_ttl_s: float = option(DEFAULT_PROBE_TTL_S, number(0, 3600, min_open=True))
    probe_timeout_s: float = option(DEFAULT_PROBE_TIMEOUT_S, number(0, 3600, min_open=True))
