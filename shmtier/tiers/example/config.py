"""``example`` tier options (any process)."""

from __future__ import annotations

from dataclasses import dataclass

from shmtier.options import integer
from shmtier.tiers.config import TierConfig, option


@dataclass(frozen=True)
class ExampleTierConfig(TierConfig):
    """The in-memory reference tier (as vLLM's example tier, but it keeps the bytes)."""

    custom_param: int = option(0, integer(),
                               doc="the tier's info label example_info (as vLLM's example tier)")
