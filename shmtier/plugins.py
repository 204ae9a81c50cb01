"""Name -> class registries with out-of-tree loading (cache policies, secondary tiers).

Both follow vLLM 0.33's factories: built-in names are registered lazily
(module imported on first use); an unregistered name is taken as a class name
in ``module_path`` (experimental), which must subclass one of ``bases``.
Every failure is a ValueError naming the config key, the value and what is
accepted. Runs wherever configs are resolved (scheduler, front end).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)


def import_attr(path: str) -> Any:
    """The object named by ``"package.module:Name"`` (the module imported now)."""
    module_path, _, name = path.partition(":")
    return getattr(importlib.import_module(module_path), name)


def unknown_name_error(what: str, name: str, known: list[str], *, key: str,
                       module_key: str) -> ValueError:
    """The error for a name that is not registered and came without a module path.
    It leads with vLLM's wording ("Unknown cache policy: 'x'."), which code may match."""
    return ValueError(
        f"Unknown {what}: {name!r}. Supported: {known}. ({key}={name!r} is not a known "
        f"{what}; accepted: {known}, or the class name of an out-of-tree {what} together "
        f"with {module_key})"
    )


def load_out_of_tree(name: str, module_path: str, bases: tuple[type, ...], *, what: str,
                     key: str, module_key: str) -> type:
    """Class ``name`` of module ``module_path``, which must subclass one of ``bases``."""
    logger.warning("Loading out-of-tree %s %r from %r (experimental API).", what, name, module_path)
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(f"{module_key}={module_path!r} cannot be imported: {e}") from e
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"{key}={name!r}: module {module_path!r} has no attribute {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, bases)):
        raise ValueError(
            f"{key}={name!r} from {module_path!r} is {cls!r}, not a "
            f"{' or '.join(b.__qualname__ for b in bases[:1])} subclass"
        )
    return cls


class LazyRegistry:
    """``what`` names the kind of thing in messages (e.g. "cache policy")."""

    def __init__(self, what: str):
        self.what = what
        self._paths: dict[str, str] = {}

    def register(self, name: str, module_path: str, class_name: str) -> None:
        if name in self._paths:
            raise ValueError(f"{self.what.capitalize()} '{name}' is already registered.")
        self._paths[name] = f"{module_path}:{class_name}"

    def names(self) -> list[str]:
        return list(self._paths)

    def resolve(self, name: str, module_path: str | None,
                bases: tuple[type, ...] | Callable[[], tuple[type, ...]], *,
                key: str, module_key: str) -> type:
        """The class for ``name`` (from the registry, else from ``module_path``, which
        must subclass one of ``bases``: a tuple, or a function returning one, called only
        for an out-of-tree class, so a registered name never imports vLLM)."""
        if name in self._paths:
            return import_attr(self._paths[name])
        if not module_path:
            raise unknown_name_error(self.what, name, self.names(), key=key, module_key=module_key)
        return load_out_of_tree(name, module_path, bases() if callable(bases) else bases,
                                what=self.what, key=key, module_key=module_key)


def with_vllm_base(own: type, vllm_module: str, vllm_name: str) -> tuple[type, ...]:
    """``(own,)`` plus vLLM's class of the same role when vLLM is importable here,
    so a plugin written against vLLM's interface loads unchanged."""
    try:
        return (own, getattr(importlib.import_module(vllm_module), vllm_name))
    except Exception:  # vLLM absent or not importable: shmtier's interface only
        return (own,)
