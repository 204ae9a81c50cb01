"""The tier registry: one entry per tier type, the only place a tier type is named.

Who calls: the spec (to check each tier's options and to tell which tiers need
tier workers), the tier factory (to build scheduler halves), and the tier worker's
job loop (to build backends). Any process; never blocks (a lookup imports the
named module on first use).

An entry names its classes by import path (imported lazily, so a worker never
imports a scheduler half and the API server imports neither):

- ``config``: the tier's frozen options (``shmtier.tiers.config.TierConfig``);
- ``scheduler``: its scheduler half (``SecondaryTierManager``);
- ``backend``: its worker half (``shmtier.tiers.backend.TierBackend``), or None for a
  tier that does its own I/O in the scheduler process (as every tier written for
  vLLM does);
- ``fsck``: its part of ``shmtier fsck`` and ``shmtier clean``
  (``shmtier.tiers.commands.TierFsck``), or None;
- ``status``: its part of ``shmtier top`` (``shmtier.tiers.commands.TierStatus``), or None;

and holds one piece of plain data, ``backpressure`` (a :class:`BackpressureProfile`: how
the default backpressure detector's defaults fit the tier). Nothing else in shmtier names
a tier type: ``shmtier/cli.py``, ``shmtier/top.py`` and the backpressure defaults
(``shmtier/scheduler/backpressure/validation.py``) ask this module.

Adding a built-in tier: a folder ``shmtier/tiers/<type>/`` with ``config.py``,
``scheduler.py`` and (for worker-backed I/O) ``backend.py``, and one line in
``BUILT_IN`` below. A tier of a user's own package registers itself with vLLM's
``SecondaryTierFactory.register_tier`` or is named with ``module_path`` (it gets the
default backpressure profile and no fsck or top status); one that wants those registers
a :class:`TierType` here (:func:`register`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shmtier.plugins import import_attr, load_out_of_tree, unknown_name_error, with_vllm_base

_PASS_THROUGH = "shmtier.tiers.config:PassThroughTierConfig"
WHAT = "secondary tier type"


@dataclass(frozen=True)
class BackpressureProfile:
    """How the EMA backpressure detector's per-tier defaults fit a tier type
    (``ema_default_config`` in ``shmtier/scheduler/backpressure/validation.py``).

    ``network``: its stores cross a network, so the network water marks apply whatever
    the tier's locality (a ``REMOTE`` locality gets them anyway). ``failures_are_pressure``:
    failed stores count as pressure (``failure_threshold`` defaults to 3), for a medium
    whose failures mean it is full or unwell.
    """

    network: bool = False
    failures_are_pressure: bool = False


DEFAULT_BACKPRESSURE = BackpressureProfile()


@dataclass(frozen=True)
class TierType:
    """A tier type: its name, the import paths (``"module:Class"``) of its pieces, and
    its backpressure profile."""

    name: str
    scheduler: str
    config: str = _PASS_THROUGH
    backend: str | None = None
    fsck: str | None = None
    status: str | None = None
    backpressure: BackpressureProfile = DEFAULT_BACKPRESSURE

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
             backend="shmtier.tiers.fs.backend:FsBackend",
             fsck="shmtier.tiers.fs.commands:FsFsck",
             backpressure=BackpressureProfile(failures_are_pressure=True)),
    TierType("obj", "shmtier.tiers.obj.scheduler:ObjTierManager",
             config="shmtier.tiers.obj.config:ObjTierConfig",
             backend="shmtier.tiers.obj.backend:ObjBackend",
             fsck="shmtier.tiers.obj.commands:ObjFsck",
             backpressure=BackpressureProfile(network=True, failures_are_pressure=True)),
    # one shared-memory pool per host for every engine of a layout (docs/node-pool.md)
    TierType("node", "shmtier.tiers.node.scheduler:NodeTierManager",
             config="shmtier.tiers.node.config:NodeTierConfig",
             backend="shmtier.tiers.node.backend:NodeBackend",
             fsck="shmtier.tiers.node.commands:NodeFsck",
             status="shmtier.tiers.node.commands:NodeStatus"),
    # no backend: its own endpoint process (spawned by the scheduler half) does the I/O
    TierType("p2p", "shmtier.tiers.p2p.scheduler:P2PTierManager",
             config="shmtier.tiers.p2p.config:P2PTierConfig",
             fsck="shmtier.tiers.p2p.socket_dirs:P2PFsck",
             status="shmtier.tiers.p2p.status:P2PStatus"),
)

_registry: dict[str, TierType] = {t.name: t for t in BUILT_IN}
_BUILT_IN_NAMES = frozenset(_registry)


def register(tier: TierType) -> None:
    """Add a tier type; registering a name twice is an error (as in vLLM)."""
    if tier.name in _registry:
        raise ValueError(f"Tier '{tier.name}' is already registered.")
    _registry[tier.name] = tier


def unregister(name: str) -> None:
    """Remove a tier type :func:`register` added (a plugin unloaded, a test's tier);
    the built-in types stay. ValueError for a built-in or unknown name."""
    if name in _BUILT_IN_NAMES or name not in _registry:
        raise ValueError(f"Tier {name!r} is not a registered out-of-tree tier type.")
    del _registry[name]


def names() -> list[str]:
    return list(_registry)


def registered(name: str) -> TierType | None:
    """The registered tier type ``name`` (None if none): the job loop's lookup."""
    return _registry.get(name)


def backpressure_profile(name: str) -> BackpressureProfile:
    """The backpressure profile of tier type ``name``; the default for a type not
    registered (a tier named by ``module_path``)."""
    tier = _registry.get(name)
    return DEFAULT_BACKPRESSURE if tier is None else tier.backpressure


def fsck_tools() -> list:
    """A :class:`shmtier.tiers.commands.TierFsck` of each registered tier type that has
    one, in registry order (imports their modules: the ``shmtier`` CLI's process)."""
    return [import_attr(t.fsck)(t.name) for t in _registry.values() if t.fsck]


def status_tools() -> list:
    """A :class:`shmtier.tiers.commands.TierStatus` of each registered tier type that has
    one, in registry order (imports their modules: the ``shmtier`` CLI's process)."""
    return [import_attr(t.status)(t.name) for t in _registry.values() if t.status]


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
