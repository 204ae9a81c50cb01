"""The tier registry: one entry per tier type, the only place a tier type is named.

Who calls: the spec (to check each tier's options and to tell which tiers need
tier workers), the tier factory (to build scheduler halves), and the tier worker's
job loop (to build backends). Any process; never blocks (a lookup imports the
named module on first use).

An entry names three classes by import path (imported lazily, so a worker never
imports a scheduler half and the API server imports neither):

- ``config``: the tier's frozen options (``shmtier.tiers.config.TierConfig``);
- ``scheduler``: its scheduler half (``SecondaryTierManager``);
- ``backend``: its worker half (``shmtier.tiers.backend.TierBackend``), or None for a
  tier that does its own I/O in the scheduler process (as every tier written for
  vLLM does).

Adding a built-in tier: a folder ``shmtier/tiers/<type>/`` with ``config.py``,
``scheduler.py`` and (for worker-backed I/O) ``backend.py``, and one line in
``BUILT_IN`` below. A tier of a user's own package registers itself with vLLM's
``SecondaryTierFactory.register_tier`` or is named with ``module_path``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmtier.plugins import import_attr, load_out_of_tree, unknown_name_error, with_vllm_base

_PASS_THROUGH = "shmtier.tiers.config:PassThroughTierConfig"
WHAT = "secondary tier type"


@dataclass(frozen=True)
class TierType:
    """A tier type: its name and the import paths (``"module:Class"``) of its pieces."""

    name: str
    scheduler: str
    config: str = _PASS_THROUGH
    backend: str | None = None

    def scheduler_class(self) -> type:
        return import_attr(self.scheduler)

    def config_class(self) -> type:
        return import_attr(self.config)

    def backend_class(self) -> type | None:
        return import_attr(self.backend) if self.backend else None

    @property
    def worker_backed(self) -> bool:
        """Whether the tier's I/O runs in tier worker processes."""
        return self.backend is not None


BUILT_IN = (
    TierType("example", "shmtier.tiers.example.scheduler:ExampleSecondaryTierManager",
             config="shmtier.tiers.example.config:ExampleTierConfig"),
    TierType("fs", "shmtier.tiers.fs.scheduler:FsTierManager",
             config="shmtier.tiers.fs.config:FsTierConfig",
             backend="shmtier.tiers.fs.backend:FsBackend"),
    TierType("obj", "shmtier.tiers.obj.scheduler:ObjTierManager",
             config="shmtier.tiers.obj.config:ObjTierConfig",
             backend="shmtier.tiers.obj.backend:ObjBackend"),
    # no backend: its own endpoint process (spawned by the scheduler half) does the I/O
    TierType("p2p", "shmtier.tiers.p2p.scheduler:P2PTierManager",
             config="shmtier.tiers.p2p.config:P2PTierConfig"),
)

_registry: dict[str, TierType] = {t.name: t for t in BUILT_IN}


def register(tier: TierType) -> None:
    """Add a tier type; registering a name twice is an error (as in vLLM)."""
    if tier.name in _registry:
        raise ValueError(f"Tier '{tier.name}' is already registered.")
    _registry[tier.name] = tier


def names() -> list[str]:
    return list(_registry)


def registered(name: str) -> TierType | None:
    """The registered tier type ``name`` (None if none): the job loop's lookup."""
    return _registry.get(name)


def resolve(tier_type: str, module_path: str | None, *, where: str) -> TierType:
    """The tier type a config names: registered, else the class ``tier_type`` of
    ``module_path`` (checked now: importable, a SecondaryTierManager of shmtier or
    vLLM). ValueError naming ``where``'s keys otherwise."""
    known = _registry.get(tier_type)
    if known is not None:
        return known
    key, module_key = f"{where}.type", f"{where}.module_path"
    if not module_path:
        raise unknown_name_error(WHAT, tier_type, names(), key=key, module_key=module_key)
    from shmtier.scheduler.tiering.base import SecondaryTierManager

    bases = with_vllm_base(SecondaryTierManager, "vllm.v1.kv_offload.tiering.base",
                           "SecondaryTierManager")
    load_out_of_tree(tier_type, module_path, bases, what=WHAT, key=key, module_key=module_key)
    return TierType(tier_type, f"{module_path}:{tier_type}")
