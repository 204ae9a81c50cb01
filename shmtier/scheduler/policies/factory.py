"""Resolve an ``eviction_policy`` name to a policy class (vLLM 0.33 factory semantics).

Built-ins: ``lru`` and ``arc``. ``register_cache_policy`` adds names (lazily
imported). An unregistered name is loaded from ``cache_policy_module_path``
when given: the module's attribute of that name, which must be a
``CachePolicy`` subclass (shmtier's, or vLLM's when vLLM is installed, so a
policy written for vLLM loads unchanged).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

from shmtier.scheduler.policies.base import CachePolicy

logger = logging.getLogger(__name__)


class CachePolicyFactory:
    _registry: dict[str, Callable[[], type]] = {}

    @classmethod
    def register_cache_policy(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``name`` -> ``module_path.class_name``; re-registration is an error."""
        if name in cls._registry:
            raise ValueError(f"Cache policy '{name}' is already registered.")

        def loader() -> type:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def supported(cls) -> list[str]:
        return list(cls._registry)

    @classmethod
    def get_cache_policy_cls(cls, name: str, module_path: str | None = None) -> type:
        """The policy class for ``name``; ValueError naming what is accepted otherwise."""
        if name in cls._registry:
            return cls._registry[name]()
        if not module_path:
            raise ValueError(
                f"eviction_policy={name!r} is not a known cache policy; accepted: "
                f"{cls.supported()}, or the class name of an out-of-tree policy together "
                f"with cache_policy_module_path"
            )
        logger.warning("Loading out-of-tree cache policy %r from %r (experimental API).",
                       name, module_path)
        try:
            module = importlib.import_module(module_path)
        except ImportError as e:
            raise ValueError(
                f"cache_policy_module_path={module_path!r} cannot be imported: {e}"
            ) from e
        policy_cls = getattr(module, name, None)
        if policy_cls is None:
            raise ValueError(
                f"eviction_policy={name!r}: module {module_path!r} has no attribute {name!r}"
            )
        if not (isinstance(policy_cls, type) and issubclass(policy_cls, _policy_bases())):
            raise ValueError(
                f"eviction_policy={name!r} from {module_path!r} is {policy_cls!r}, "
                f"not a CachePolicy subclass"
            )
        return policy_cls


def _policy_bases() -> tuple[type, ...]:
    try:
        from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as VllmCachePolicy
    except Exception:  # vLLM absent or not importable here: only shmtier's base
        return (CachePolicy,)
    return (CachePolicy, VllmCachePolicy)


CachePolicyFactory.register_cache_policy("lru", "shmtier.scheduler.policies.lru", "LRUCachePolicy")
CachePolicyFactory.register_cache_policy("arc", "shmtier.scheduler.policies.arc", "ARCCachePolicy")
