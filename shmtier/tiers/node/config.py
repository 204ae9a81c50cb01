"""``node`` tier options (any process): what ``secondary_tiers[i]`` of type ``node`` accepts.

Checked when the spec is built, so a ``size_bytes`` too small for one chunk row or a
``pool`` name that cannot name a shared-memory object fails there, naming the key,
before any process or segment is made. The pool's name is resolved here too: with
``pool`` null it is the engine id without vLLM's data-parallel suffix
(:func:`default_pool_name`), so the tier workers receive the name the scheduler half
attaches to with the rest of this config (``shmtier/shared/pool_config.py``).

Whether an engine may join a pool (the same ``size_bytes``, the same layout) is the
pool's to say when it attaches (``shmtier/tiers/node/pool.py``): only the pool knows
what the first engine made it with. What a pool name may hold is the pool's rule too
(``shmtier/tiers/node/layout.py``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from shmtier.options import Check, ConfigError, boolean, integer
from shmtier.shared.layout import PAGE_SIZE, round_up
from shmtier.tiers.config import TierConfig, TierContext, option
from shmtier.tiers.node.layout import NAME_PREFIX, POOL_NAME_ACCEPTED, POOL_NAME_RE

POOL_NAME_MAX = 64
# vLLM names each data-parallel replica's engine "<engine_id>_dp<rank>", the global rank
# (docs/vllm-contract.md, OffloadingConfig's engine_id).
_DP_SUFFIX = re.compile(r"_dp\d+$")
#: ``size_bytes`` when not given.
DEFAULT_SIZE_BYTES = 1 << 30


def default_pool_name(engine_id: str) -> str:
    """The pool an engine joins when ``pool`` is null: its engine id without a trailing
    ``_dp<rank>``, so every data-parallel replica of one vLLM deployment shares one pool
    with no per-replica config. Characters a pool name cannot hold become ``_``; a name
    changed so, or longer than 64 characters, ends in a digest of the id (two ids never
    meet by losing their differences)."""
    base = _DP_SUFFIX.sub("", engine_id) or engine_id
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", base)
    if not safe or safe != base or len(safe) > POOL_NAME_MAX:
        digest = hashlib.sha256(base.encode()).hexdigest()[:12]
        safe = f"{safe[:POOL_NAME_MAX - 13]}-{digest}"
    return safe


def _pool_name() -> Check:
    def convert(v):
        if not isinstance(v, str) or not POOL_NAME_RE.fullmatch(v):
            raise ValueError("")
        return v
    return Check(f"a string of {POOL_NAME_ACCEPTED}", convert)


@dataclass(frozen=True, kw_only=True)
class NodeTierConfig(TierConfig):
    """A ``node`` tier: chunks kept in one shared-memory pool per host that every engine
    of one layout naming the same pool shares (data-parallel replicas with no ``pool``
    given, independent engines with the same ``pool``); lookups read its index directly
    (HIT or MISS at once), the tier workers copy chunks in and out
    (docs/node-pool.md)."""

    size_bytes: int = option(
        DEFAULT_SIZE_BYTES, integer(1),
        doc="bytes of the pool's chunk rows, for the whole host (its one capacity bound: "
            "least recently used chunks are evicted); at least one chunk row; every engine "
            "of a pool must give the same value (the first one sizes it)",
        default_doc="`1073741824` (1 GiB)")
    pool: str | None = option(
        None, _pool_name().or_none("null (the engine id without its data-parallel "
                                   "suffix)"),
        doc=f"the pool's name (/dev/shm/{NAME_PREFIX}<pool>); null: the engine id without "
            "vLLM's `_dp<rank>` suffix, so the data-parallel replicas of one deployment "
            "share a pool; name one for independent engines to share")
    keep: bool = option(
        False, boolean(),
        doc="the last engine to leave keeps the pool in /dev/shm (a restarted engine "
            "finds its chunks); false: it removes it")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, where: str,
                     context: TierContext = TierContext()) -> "NodeTierConfig":
        config = super().from_options(options, where=where, context=context)
        if config.pool is None and context.engine_id is not None:
            config = replace(config, pool=default_pool_name(context.engine_id))
        return config

    def check_together(self, where: str, context: TierContext) -> None:
        if context.chunk_bytes is None:
            return
        row = round_up(context.chunk_bytes, PAGE_SIZE)
        if self.size_bytes < row:
            raise ConfigError(
                f"{where}.size_bytes = {self.size_bytes} is invalid: expected at least one "
                f"chunk row of this engine's layout ({row} bytes: {context.chunk_bytes} "
                f"bytes of KV per chunk, page aligned)")

    def pool_for(self, engine_id: str) -> str:
        """The pool's name for engine ``engine_id`` (``pool``, or its default)."""
        return self.pool if self.pool is not None else default_pool_name(engine_id)

    @classmethod
    def check_engine_tiers(cls, tiers: Iterable[Any]) -> None:
        """One engine's checked ``secondary_tiers`` together: no two node tiers name the
        same pool (the second would only find every chunk there already)."""
        seen: dict[str, str] = {}
        for tier in tiers:
            config = getattr(tier, "options", None)
            if not isinstance(config, NodeTierConfig) or config.pool is None:
                continue
            other = seen.get(config.pool)
            if other is not None:
                raise ConfigError(
                    f"{tier.where}.pool = {config.pool!r} is invalid: {other} is the same "
                    f"pool (as named or derived from the engine id); expected one node tier "
                    f"per pool")
            seen[config.pool] = tier.where
