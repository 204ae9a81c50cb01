"""What a tier type adds to the ``shmtier`` command: its part of ``fsck`` and ``clean``
(:class:`TierFsck`) and of ``top`` and ``ls`` (:class:`TierStatus`).

Runs in: the ``shmtier`` CLI's process (and tests). A tier type names its subclasses in
its registry entry (``fsck=``, ``status=`` in ``shmtier/tiers/registry.py``), which makes
one of each with the type's name; ``shmtier/cli.py`` and ``shmtier/top.py`` ask the
registry for them and name no tier type. The CLI imports every registered tool to build
its parser, so a tool's module must import cheaply: a tool imports the tier's walking code
inside ``run`` (may block there on the filesystem or the network), never at the top.
"""

from __future__ import annotations

import argparse
from typing import Any


class TierFsck:
    """A tier type's part of ``shmtier fsck`` (check and repair what the tier stores) and
    of ``shmtier clean``. One instance per registered type; ``tier_type`` is its name.

    ``target``: what it checks, for the command's help ("an fs tier root"); ``usage``:
    how a user names one, for the error when none or several are named ("an fs tier
    ROOT"); ``clean_what``: what ``shmtier clean`` removes for it, for its help ("" when
    nothing).
    """

    target = ""
    usage = ""
    clean_what = ""

    def __init__(self, tier_type: str) -> None:
        self.tier_type = tier_type

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the arguments that name this tier's target (and its own options) to the
        ``fsck`` parser. The shared ones are there already: ``--verify``, ``--repair``,
        ``--json``, ``--mac-key-file``."""

    def chosen(self, args: argparse.Namespace) -> bool:
        """Whether the parsed ``args`` name this tier's target (exactly one tier may)."""
        return False

    def run(self, args: argparse.Namespace, mac_key: bytes | None) -> Any:
        """Check (and with ``args.repair`` repair) the target; a report with ``as_dict()``,
        ``text()`` and ``exit_code`` (``shmtier.storage.fsck.FsckReport``). Raises
        ``FsckError``, ``ValueError`` or ``OSError`` for a target that cannot be checked."""
        raise NotImplementedError

    def engine_died(self, tiers: list) -> list[str]:
        """An engine died without closing its segment: what this tier keeps on the host
        for it goes (the node tier detaches it from its pools; the last engine out removes
        a pool unless kept). ``tiers``: the engine's tiers as its segment named them
        (``shmtier.shared.snapshot.TierInfo``: ``type``, ``where``), read before the
        segment was removed. Called by the segment's guardian process
        (``shmtier/shared/segment_guardian.py``); may block briefly (a lock). Returns
        lines for its log; never raises for a tier that is gone."""
        return []

    def add_clean_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this tier's arguments to the ``clean`` parser (none by default)."""

    def clean(self, args: argparse.Namespace) -> tuple[list[str], int]:
        """``shmtier clean``'s part for this tier: the lines to print (one per thing
        removed) and an exit code (0, or 2 when a target was unusable; the error is
        printed here, on stderr)."""
        return [], 0


class TierStatus:
    """A tier type's part of ``shmtier top``: what the tier reports of an engine beyond
    the segment (e.g. the p2p tier's endpoint sessions). ``top --json`` holds
    ``sessions`` under the type's name; the text view prints ``lines`` of each."""

    def __init__(self, tier_type: str) -> None:
        self.tier_type = tier_type

    def sessions(self, engine_id: str) -> list[dict]:
        """What the tier reports of engine ``engine_id`` now (JSON-able dicts; empty when
        it has nothing). Must not disturb the engine, and must not raise for an engine
        that does not use the tier."""
        return []

    def lines(self, session: dict) -> list[str]:
        """One of ``sessions``' (or ``host``'s) entries in words, for the text view."""
        return []

    def host(self) -> list[dict]:
        """What the tier keeps on this host beside the engines' segments (e.g. the node
        tier's pools), for ``shmtier ls`` (``ls --host --json``: under the type's name):
        JSON-able dicts, each shown by ``lines``; empty when it keeps nothing. Must not
        disturb any engine."""
        return []


def read_mac_key(path: str) -> bytes:
    """A MAC key file, read and checked as the tiers' ``mac_key_file`` option is
    (``--mac-key-file``, a tier config's ``mac_key_file``). ValueError naming the file."""
    from shmtier.options import ConfigError, secret_file
    from shmtier.shared.codec import MAC_KEY_BYTES

    try:
        return secret_file(*MAC_KEY_BYTES)("--mac-key-file", path).value
    except ConfigError as e:
        raise ValueError(str(e)) from None
