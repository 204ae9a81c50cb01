"""``example`` tier options (any process)."""

from __future__ import annotations

from dataclasses import dataclass

from shmtier.options import integer
from shmtier.tiers.config import TierConfig, option


@dataclass(frozen=True)
class ExampleTierConfig(TierConfig):
    """``custom_param``: the tier's info label ``example_info`` (as vLLM's example tier)."""

    custom_param: int = option(0, integer())
