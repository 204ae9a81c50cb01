"""Which secondary tiers a lookup asks (scheduler process): those a request's
``load_tier_filter`` lets serve loads (docs/vllm-contract.md §6), in priority order, less
the tier serving an external request.

Memoised per (filter, excluded tier): a lookup runs per key. A hashable filter is taken
as immutable (as vLLM's frozen ``TierFilter``); an unhashable one is evaluated every time.
The manager keeps the last answer and finds it by identity (consecutive lookups, a
request's scan, pass the same filter object).

Who calls: :class:`~shmtier.scheduler.tiering.manager.TieringOffloadingManager`'s
``lookup``, under its lock, when the filter changes. Pure; never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shmtier.contract import Locality, Medium, tier_filter_allows
from shmtier.scheduler.tiering.base import optional_attribute

_MEMO_MAX = 64  # distinct (load_tier_filter, excluded tier) pairs remembered


def _same_enum(enum_cls, value):
    return None if value is None else enum_cls[value.name] if hasattr(value, "name") else enum_cls(value)


class LookupTiers:
    """The tiers of one manager, and the lists of (index, tier) a lookup asks."""

    __slots__ = ("_tiers", "_kind", "_memo")

    def __init__(self, tiers: Sequence[Any]):
        self._tiers = list(tiers)
        # A tier written for vLLM speaks vLLM's enums: map them to ours once, by name.
        self._kind = [
            (_same_enum(Medium, t.medium), _same_enum(Locality, optional_attribute(t, "locality")))
            for t in self._tiers]
        self._memo: dict[tuple[Any, int | None], list[tuple[int, Any]]] = {}

    def memoised(self, allowed: Any, exclude_tier_idx: int | None) -> list[tuple[int, Any]] | None:
        """The tiers for a hashable ``allowed`` (remembered), or None for an unhashable one."""
        memo = self._memo
        try:
            return memo[allowed, exclude_tier_idx]
        except KeyError:
            if len(memo) >= _MEMO_MAX:
                memo.clear()
            tiers = memo[allowed, exclude_tier_idx] = self.evaluate(allowed, exclude_tier_idx)
            return tiers
        except TypeError:  # an unhashable filter
            return None

    def evaluate(self, allowed: Any, exclude_tier_idx: int | None) -> list[tuple[int, Any]]:
        return [(i, tier) for i, tier in enumerate(self._tiers)
                if i != exclude_tier_idx and tier_filter_allows(allowed, *self._kind[i])]
