"""Build secondary tiers (vLLM 0.33's ``SecondaryTierFactory``), in the scheduler process.

Who calls: the spec's ``get_manager`` (with the checked ``SecondaryTierConfig`` of
each tier), or code written for vLLM with a tier dict. Tier types come from the tier
registry (``shmtier/tiers/registry.py``): a registered name, or with ``module_path``
the class of that name in that module (a subclass of shmtier's or vLLM's
``SecondaryTierManager``, so a tier written for vLLM loads unchanged). The tier's
``backpressure`` settings become its detector here, the only place one is built;
the tier's options reach its constructor as its config class says (a built-in tier
gets its frozen config, any other tier the keyword arguments as vLLM passes them).
"""

from __future__ import annotations

from typing import Any

from shmtier.config import SecondaryTierConfig, resolve_tier_type
from shmtier.scheduler.backpressure import build_detector
from shmtier.tiers import registry
from shmtier.tiers.config import TierContext
from shmtier.tiers.registry import TierType


class SecondaryTierFactory:
    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register ``tier_type`` -> ``module_path.class_name`` (imported lazily); its
        options go to its constructor unchecked, as in vLLM."""
        registry.register(TierType(tier_type, f"{module_path}:{class_name}"))

    @classmethod
    def registered(cls) -> list[str]:
        return registry.names()

    @classmethod
    def get_tier_class(cls, config: dict[str, Any], where: str = "secondary_tiers[?]") -> type:
        """The scheduler-half class a tier dict names (ValueError naming the problem)."""
        return resolve_tier_type(config, where).scheduler_class()

    @classmethod
    def create_secondary_tier(cls, config: dict[str, Any] | SecondaryTierConfig,
                              primary_kv_view: memoryview, offloading_spec: Any, *,
                              where: str = "secondary_tiers[?]",
                              context: TierContext = TierContext()) -> Any:
        """Construct one tier from its checked config, or from a tier dict (checked here,
        its ``backpressure`` block built into a detector as vLLM's factory does)."""
        if not isinstance(config, SecondaryTierConfig):  # a ConfigError is a ValueError
            config = SecondaryTierConfig.from_dict(config, where=where, context=context)
        detector = build_detector(config.backpressure) if config.backpressure is not None else None
        tier_cls = config.tier.scheduler_class()
        try:
            return tier_cls(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                            tier_type=config.type, backpressure_detector=detector,
                            **config.options.constructor_kwargs())
        except TypeError as e:
            raise ValueError(f"{config.where} ({config.type}): invalid tier option: {e}") from e
