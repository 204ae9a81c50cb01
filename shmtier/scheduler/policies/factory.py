"""Resolve an ``eviction_policy`` name to a policy class (vLLM 0.33 factory semantics).

Built-ins: ``lru`` and ``arc``. ``register_cache_policy`` adds names (lazily
imported). An unregistered name is loaded from ``cache_policy_module_path``
when given: the module's attribute of that name, which must be a
``CachePolicy`` subclass (shmtier's, or vLLM's when vLLM is installed, so a
policy written for vLLM loads unchanged).
"""

from __future__ import annotations

from shmtier.plugins import LazyRegistry, with_vllm_base
from shmtier.scheduler.policies.base import CachePolicy


class CachePolicyFactory:
    _registry = LazyRegistry("cache policy")

    @classmethod
    def register_cache_policy(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``name`` -> ``module_path.class_name``; re-registration is an error."""
        cls._registry.register(name, module_path, class_name)

    @classmethod
    def supported(cls) -> list[str]:
        return cls._registry.names()

    @classmethod
    def get_cache_policy_cls(cls, name: str, module_path: str | None = None) -> type:
        """The policy class for ``name``; ValueError naming what is accepted otherwise."""
        # vLLM's base only for an out-of-tree policy: importing vLLM takes seconds
        def bases():
            return with_vllm_base(CachePolicy, "vllm.v1.kv_offload.cpu.policies.base",
                                  "CachePolicy")
        policy_cls = cls._registry.resolve(name, module_path, bases, key="eviction_policy",
                                           module_key="cache_policy_module_path")
        if module_path is not None:
            _check_hooks(policy_cls, name)
        return policy_cls


def _check_hooks(policy_cls: type, name: str) -> None:
    """Refuse, naming what is missing, an out-of-tree policy without the hooks shmtier's
    CPU tier calls (0.33's interface; a policy written for vLLM 0.32 lacks
    ``on_request_access`` and takes no ``req_context`` in ``insert``)."""
    import inspect

    missing = [hook for hook in ("on_request_access", "on_request_finished", "on_store_miss")
               if not callable(getattr(policy_cls, hook, None))]
    if "req_context" not in inspect.signature(policy_cls.insert).parameters:
        missing.append("insert(key, chunk, req_context)")
    if missing:
        raise ValueError(
            f"eviction_policy = {name!r} (cache_policy_module_path) lacks what shmtier's CPU "
            f"tier calls: {', '.join(missing)}; write it for vLLM 0.33's CachePolicy "
            f"interface (a policy written for vLLM 0.32 does not fit)")


CachePolicyFactory.register_cache_policy("lru", "shmtier.scheduler.policies.lru", "LRUCachePolicy")
CachePolicyFactory.register_cache_policy("arc", "shmtier.scheduler.policies.arc", "ARCCachePolicy")
