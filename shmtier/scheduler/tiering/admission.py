"""Cascade admission: which chunks stored in the CPU tier are cascaded to a secondary tier.

vLLM 0.33 cascades every chunk the CPU tier stores (write-through, docs/vllm-contract.md §6)
and has no admission policy; shmtier's rules (docs/operating.md, "Cascade admission"; measured in
bench/README.md, "Admission"):

``all``
    vLLM's write-through: every stored chunk, when it is stored. The default. The manager
    does not consult a rule at all then, so this path is exactly the one before admission
    existed.
``second_touch``
    A chunk is cascaded on its second touch: its first store only records the key; a
    later lookup that finds it in the CPU tier (another request re-reading it while it is
    still resident), or a second store of it (it was evicted before anyone re-read it,
    recomputed and stored again), cascades it. A chunk used once is never written to the
    tier; one re-read only after its eviction is recomputed once. Keys are remembered in
    a bounded LRU list of ``window`` keys (a ghost list: it outlives the CPU tier's rows),
    O(1) per key; a key forgotten counts as never seen.

Chunks a request-level tier asked for (a hand-off to a consumer, e.g. ``p2p``) are not
subject to admission: the manager passes them as ``exempt``.

Who calls: ``TieringOffloadingManager`` (``manager.py``), in the scheduler process on the
thread that holds ``manager.lock``: ``on_store`` from ``complete_store``, ``on_hits`` when a
lookup scan ends (with the keys it found in the CPU tier), ``on_promoted`` when a promotion
lands. Pure bookkeeping: no I/O, never blocks; a rule's answer depends only on the calls
made before (deterministic).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

RULES = ("all", "second_touch")
DEFAULT_RULE = "all"
#: ``second_touch``'s default window: this many times the CPU tier's chunk rows.
DEFAULT_WINDOW_PER_ROW = 4

_SEEN, _ADMITTED = False, True


class AdmitAll:
    """vLLM's write-through: every stored chunk is cascaded, a lookup cascades nothing."""

    name = "all"
    touches = False  # whether lookups and promotions matter to it

    def __init__(self) -> None:
        self.admitted = 0
        self.skipped = 0

    def on_store(self, keys: Sequence[Any]) -> list:
        self.admitted += len(keys)
        return list(keys)

    def on_hits(self, keys: Iterable[Any]) -> list:
        return []

    def on_promoted(self, keys: Iterable[Any]) -> None:
        pass


class SecondTouch:
    """Cascade a chunk on its second touch (store or CPU-tier lookup hit); see the module
    docstring. ``window``: keys remembered (LRU), >= 1."""

    name = "second_touch"
    touches = True

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"second_touch window = {window!r} is invalid: expected an integer >= 1")
        self.window = window
        self._keys: OrderedDict[Any, bool] = OrderedDict()  # key -> admitted (else seen once)
        self.admitted = 0
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._keys)

    def _remember(self, key: Any, admitted: bool) -> None:
        keys = self._keys
        keys[key] = admitted
        keys.move_to_end(key)
        if len(keys) > self.window:
            keys.popitem(last=False)

    def on_store(self, keys: Sequence[Any]) -> list:
        """The chunks of ``keys`` (just stored in the CPU tier) to cascade now: those seen
        before. A chunk stored again was recomputed, so the tier did not serve it: it is
        cascaded again even if it was admitted before."""
        out = []
        for key in keys:
            if key in self._keys:
                out.append(key)
                self._remember(key, _ADMITTED)
            else:
                self._remember(key, _SEEN)
        self.admitted += len(out)
        self.skipped += len(keys) - len(out)
        return out

    def on_hits(self, keys: Iterable[Any]) -> list:
        """The chunks of ``keys`` (a lookup scan found them in the CPU tier) to cascade
        now: those seen once and not yet admitted. A key not remembered counts as a first
        touch."""
        out = []
        get = self._keys.get
        for key in keys:
            state = get(key)
            if state is _ADMITTED:
                self._keys.move_to_end(key)
                continue
            if state is _SEEN:
                out.append(key)
            self._remember(key, state is _SEEN)
        self.admitted += len(out)
        return out

    def on_promoted(self, keys: Iterable[Any]) -> None:
        """``keys`` came from the tier: it holds them, so a lookup hit must not cascade
        them again."""
        for key in keys:
            self._remember(key, _ADMITTED)


def make_rule(name: str, window: int) -> AdmitAll | SecondTouch:
    """A rule object by name (``RULES``); ``window`` is used by ``second_touch``."""
    if name == "all":
        return AdmitAll()
    if name == "second_touch":
        return SecondTouch(window)
    raise ValueError(f"admission = {name!r} is invalid: expected one of {', '.join(RULES)}")


class CascadeAdmission:
    """The rules of one manager, one per secondary tier (index order). The manager keeps
    none of this when every tier's rule is ``all`` (``CascadeAdmission.build`` returns
    None), so write-through stays vLLM's path."""

    def __init__(self, rules: Sequence[AdmitAll | SecondTouch]) -> None:
        self.rules = list(rules)
        self._touched = [i for i, r in enumerate(self.rules) if r.touches]

    @classmethod
    def build(cls, names: Sequence[str], window: int) -> "CascadeAdmission | None":
        """Rules for tiers named ``names`` (one per tier); None if all are ``all``."""
        if all(n == "all" for n in names):
            return None
        return cls([make_rule(n, window) for n in names])

    def on_store(self, keys: list, exempt: Iterable[int] = ()) -> list[tuple[int, list]]:
        """(tier index, keys to cascade now) for chunks just stored; tiers in ``exempt``
        (the request's request-level tiers) get every key, and their rules count the keys
        as held by the tier."""
        out = []
        for i, rule in enumerate(self.rules):
            if i in exempt:
                rule.on_promoted(keys)  # the tier will hold them: a hit must not cascade them
                admitted = keys
            else:
                admitted = rule.on_store(keys)
            if admitted:
                out.append((i, admitted))
        return out

    def on_hits(self, keys: Iterable[Any]) -> list[tuple[int, list]]:
        """(tier index, keys to cascade now) for chunks a lookup scan found in the CPU tier."""
        out = []
        if not self._touched:
            return out
        keys = list(keys)
        for i in self._touched:
            admitted = self.rules[i].on_hits(keys)
            if admitted:
                out.append((i, admitted))
        return out

    def on_promoted(self, tier_idx: int, keys: Iterable[Any]) -> None:
        rule = self.rules[tier_idx]
        if rule.touches:
            rule.on_promoted(keys)
