"""Build secondary tiers from their config dicts (vLLM 0.33 ``SecondaryTierFactory``).

``type`` names a registered tier, or with ``module_path`` the class of that
name in that module (a subclass of shmtier's or vLLM's SecondaryTierManager,
so a tier written for vLLM loads unchanged). ``backpressure`` becomes the
tier's detector (merged field by field over the top-level block); every other
key is passed to the tier's constructor as a keyword argument.
"""

from __future__ import annotations

from typing import Any

from shmtier.plugins import LazyRegistry, with_vllm_base
from shmtier.scheduler.tiering.base import SecondaryTierManager


class SecondaryTierFactory:
    _registry = LazyRegistry("tier type")

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register ``tier_type`` -> ``module_path.class_name`` (imported lazily)."""
        cls._registry.register(tier_type, module_path, class_name)

    @classmethod
    def registered(cls) -> list[str]:
        return cls._registry.names()

    @classmethod
    def get_tier_class(cls, config: dict[str, Any], where: str = "secondary_tiers[?]") -> type:
        if not isinstance(config, dict):
            raise ValueError(f"{where} = {config!r} is invalid: expected a dict with a 'type' key")
        tier_type = config.get("type")
        if not isinstance(tier_type, str) or not tier_type:
            raise ValueError(
                f"{where}.type = {tier_type!r} is invalid: expected one of {cls.registered()} "
                f"or an out-of-tree class name with module_path"
            )
        bases = with_vllm_base(SecondaryTierManager, "vllm.v1.kv_offload.tiering.base",
                               "SecondaryTierManager")
        return cls._registry.resolve(tier_type, config.get("module_path"), bases,
                                     key=f"{where}.type", module_key=f"{where}.module_path")

    @classmethod
    def create_secondary_tier(cls, config: dict[str, Any], primary_kv_view: memoryview,
                              offloading_spec: Any, *, detector: Any = None,
                              where: str = "secondary_tiers[?]") -> Any:
        """Construct one tier; ``detector`` is its already-built backpressure detector."""
        tier_cls = cls.get_tier_class(config, where)
        kwargs = dict(config)
        tier_type = kwargs.pop("type")
        kwargs.pop("module_path", None)
        kwargs.pop("backpressure", None)
        try:
            return tier_cls(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                            tier_type=tier_type, backpressure_detector=detector, **kwargs)
        except TypeError as e:
            raise ValueError(f"{where} ({tier_type}): invalid tier option: {e}") from e


SecondaryTierFactory.register_tier("example", "shmtier.tiers.example.scheduler",
                                   "ExampleSecondaryTierManager")
SecondaryTierFactory.register_tier("fs", "shmtier.tiers.fs.scheduler", "FsTierManager")

#: Built-in tier types whose I/O runs in tier worker processes (the backend kind each uses).
WORKER_BACKED = {"fs": "fs"}
