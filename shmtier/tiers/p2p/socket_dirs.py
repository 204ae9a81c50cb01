"""The p2p tier's socket directories, and who removes them: :func:`make`,
:func:`remove_stale`, and :class:`P2PFsck`, the tier's part of ``shmtier clean`` and of
the segment guardian (named in the tier registry).

One directory per engine's p2p tier, ``$TMPDIR/shmtier-p2p-<engine_id>-XXXXXXXX/`` (mode
0700): the endpoint's ipc sockets (``supervisor.py``), its status file (``status.py``)
and ``owner``, the scheduler process that made it as (pid, start time, boot id).

Runs in: the scheduler process (``make``, when the tier starts), the endpoint process,
the segment guardian's process and the ``shmtier`` CLI's (``remove_stale``). Imports no
zmq. Never raises for a directory that vanishes meanwhile.

Who removes a directory:

- the scheduler half's shutdown (``EndpointSupervisor.shutdown``);
- the endpoint, when it finds its engine gone (its exit code 3);
- when both are SIGKILLed at once, neither. That is how vLLM stops an EngineCore that
  does not exit at once: it SIGKILLs it and every process descended from it, the
  endpoint included. Then the engine's segment guardian (a process outside that tree:
  ``shmtier/shared/segment_guardian.py``) calls :meth:`P2PFsck.engine_died`, which
  removes every socket directory whose owner is dead; ``shmtier clean`` does the same
  for an engine that ran without a guardian (``warm_restart``).

A directory is stale when its ``owner`` names a process that is not running: the
guardian removes only those. ``shmtier clean`` also removes the directories of engines
of a shmtier before the ``owner`` file (the operator's explicit command): one without a
readable ``owner`` that holds nothing but what an endpoint writes (its sockets, its
status file) and in which nothing was written for ``UNOWNED_GRACE_S`` (a live endpoint
rewrites its status file every second). Anything else under the prefix is left alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time

from shmtier.options import ConfigError
from shmtier.shared import procinfo
from shmtier.tiers.commands import TierFsck

__all__ = ["DIR_PREFIX", "OWNER_FILE", "P2PFsck", "make", "remove_stale", "stale"]

DIR_PREFIX = "shmtier-p2p-"
OWNER_FILE = "owner"
UNOWNED_GRACE_S = 60.0
_SUFFIX_LEN = 9  # mkdtemp's "-" + 8 random characters after the engine id
#: the longest socket name the supervisor gives an endpoint (``ep<generation % 10000>.sock``)
LONGEST_SOCKET = "ep9999.sock"
#: bytes of a Unix socket's path (``sizeof(sockaddr_un.sun_path)`` less its NUL)
SOCKET_PATH_MAX = 107
# what an endpoint writes in its engine's directory (supervisor.py, status.py)
_ENDPOINT_FILES = re.compile(r"ep\d+\.sock|status\.json(\.\d+\.tmp)?")


def make(engine_id: str, tmp_dir: str | None = None) -> str:
    """Make the calling process's socket directory for engine ``engine_id`` (in
    ``tmp_dir``, default ``tempfile.gettempdir()``) with its ``owner`` file; its path.
    Raises ConfigError when an endpoint's socket path in it would be too long for a Unix
    socket (nothing made), OSError (the directory is removed again)."""
    base = tmp_dir or tempfile.gettempdir()
    longest = os.path.join(base, f"{DIR_PREFIX}{engine_id}-XXXXXXXX", LONGEST_SOCKET)
    if len(longest.encode()) > SOCKET_PATH_MAX:
        raise ConfigError(
            f"p2p tier of engine {engine_id!r}: its endpoint's socket path would be "
            f"{len(longest.encode())} bytes ({longest}), and a Unix socket path may have "
            f"{SOCKET_PATH_MAX}: set TMPDIR to a shorter directory (now {base!r}) or give "
            f"the engine a shorter id")
    path = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{engine_id}-", dir=base)
    pid, started = procinfo.me()
    try:
        tmp = os.path.join(path, f".{OWNER_FILE}.tmp")
        with open(tmp, "w") as f:
            json.dump({"pid": pid, "start": started, "boot": procinfo.boot_id().hex()}, f)
        os.replace(tmp, os.path.join(path, OWNER_FILE))
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def engine_of(path: str) -> str:
    """The engine id a socket directory's name carries."""
    return os.path.basename(path)[len(DIR_PREFIX):-_SUFFIX_LEN]


def _owner_alive(path: str) -> bool | None:
    """Whether the directory's owner runs; None when its ``owner`` file is missing or
    unreadable."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = json.load(f)
        return procinfo.is_alive(int(owner["pid"]), int(owner["start"]),
                                 bytes.fromhex(owner["boot"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _unowned_and_idle(path: str, now: float) -> bool:
    """Whether ``path`` holds nothing but an endpoint's files, none written for
    ``UNOWNED_GRACE_S`` (a socket directory of an older shmtier, its engine gone)."""
    try:
        latest = os.stat(path).st_mtime
        for entry in os.scandir(path):
            if not _ENDPOINT_FILES.fullmatch(entry.name):
                return False
            latest = max(latest, entry.stat(follow_symlinks=False).st_mtime)
    except OSError:
        return False
    return now - latest > UNOWNED_GRACE_S


def stale(tmp_dir: str | None = None, engine_ids: set[str] | None = None, *,
          unowned: bool = False) -> list[str]:
    """The stale socket directories (see the module docstring) in ``tmp_dir`` (default
    ``tempfile.gettempdir()``) that this user owns, sorted; only ``engine_ids``' when
    given; with ``unowned``, also the idle ones of an older shmtier."""
    base = tmp_dir or tempfile.gettempdir()
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(DIR_PREFIX)]
    except OSError:
        return []
    now = time.time()
    out = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        if engine_ids is not None and engine_of(entry.path) not in engine_ids:
            continue
        alive = _owner_alive(entry.path)
        if alive is False or (alive is None and unowned and _unowned_and_idle(entry.path, now)):
            out.append(entry.path)
    return sorted(out)


def remove_stale(tmp_dir: str | None = None, engine_ids: set[str] | None = None, *,
                 unowned: bool = False) -> list[str]:
    """Remove the :func:`stale` socket directories; the paths removed."""
    removed = []
    for path in stale(tmp_dir, engine_ids, unowned=unowned):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


class P2PFsck(TierFsck):
    """The p2p tier's part of ``shmtier clean`` and of the segment guardian: the socket
    directories of dead engines go. It stores nothing to check: ``fsck`` names no p2p
    target."""

    clean_what = "the p2p socket directories of dead engines"

    def engine_died(self, tiers: list) -> list[str]:
        """Remove every stale socket directory in this process's temp dir (the guardian
        inherits its engine's ``TMPDIR``). ``tiers`` is not read: a p2p-only engine has
        no tier in its pool config."""
        return [f"p2p socket directory {path}: its engine died; removed"
                for path in remove_stale()]

    def clean(self, args) -> tuple[list[str], int]:
        """Remove the stale socket directories, those of an older shmtier too (only the
        named engines' with ENGINE_IDs)."""
        engine_ids = set(getattr(args, "engine_ids", None) or ()) or None
        return [f"removed {path}"
                for path in remove_stale(engine_ids=engine_ids, unowned=True)], 0
