"""The p2p tier's sessions as the ``shmtier`` CLI can show them: :func:`p2p_sessions`, and
:class:`P2PStatus`, the tier's part of ``shmtier top`` (named in the tier registry).

Runs in: the endpoint process (``write_status``, once a second) and any process on the
same host that wants to see its p2p sessions (``p2p_sessions``: the CLI, tests). No
sockets, no zmq: a small JSON file per engine, ``status.json`` in the tier's socket
directory (``$TMPDIR/shmtier-p2p-<engine_id>-XXXX/``, mode 0700, removed with the
engine's tier), replaced atomically. Reading it never disturbs the engine.

What a status holds (``p2p_sessions`` returns one dict per engine)::

    engine_id, endpoint ("host:port" it listens on), pid (the endpoint process),
    plaintext, updated (time.time() of the write), age_s and alive (added by the reader:
    seconds since the write; whether the endpoint process still runs),
    parked {requests, rows}: what this engine holds for peers now,
    inbound [{name, key, refused, queued, bytes_sent}]: peers connected to its server,
    outbound [{peer, circuit, failures, retry_in_s, last_error, requests, lookups,
               chunks, bytes_received, timeouts, errors, refused}]: peers it fetches from,
    server: the server's TransportCounters (counters.py).
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time

from shmtier.tiers.commands import TierStatus
from shmtier.tiers.p2p.socket_dirs import DIR_PREFIX

__all__ = ["STATUS_FILE", "P2PStatus", "p2p_sessions", "write_status"]

STATUS_FILE = "status.json"


def write_status(path: str, status: dict) -> None:
    """Replace ``path`` with ``status`` as JSON (atomically: readers see the old or the
    new file, never a part). Raises OSError."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f, separators=(",", ":"))
    os.replace(tmp, path)


def p2p_sessions(engine_id: str | None = None, tmp_dir: str | None = None) -> list[dict]:
    """The p2p endpoints of this host's engines and their sessions (see the module
    docstring), sorted by engine id; only ``engine_id``'s when given. ``tmp_dir``: where
    the engines' tiers made their socket directories (default: this process's
    ``tempfile.gettempdir()``, the same as the engines' unless their ``TMPDIR`` differs).
    A status whose ``alive`` is False, or whose ``age_s`` is more than a few seconds, is
    from an endpoint that is gone or stopped. Never raises for an unreadable file."""
    base = tmp_dir or tempfile.gettempdir()
    pattern = os.path.join(glob.escape(base), f"{DIR_PREFIX}*", STATUS_FILE)
    now = time.time()
    out = []
    for path in glob.glob(pattern):
        try:
            with open(path) as f:
                status = json.load(f)
        except (OSError, ValueError):
            continue  # removed meanwhile, or not ours
        if not isinstance(status, dict) or "engine_id" not in status:
            continue
        if engine_id is not None and status["engine_id"] != engine_id:
            continue
        status["age_s"] = max(0.0, now - float(status.get("updated", 0)))
        status["alive"] = _alive(status.get("pid"))
        out.append(status)
    return sorted(out, key=lambda s: str(s["engine_id"]))


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class P2PStatus(TierStatus):
    """``shmtier top``'s p2p part: the engine's endpoint sessions (``p2p_sessions``),
    under ``"p2p"`` in ``--json``, and in words."""

    def sessions(self, engine_id: str) -> list[dict]:
        return p2p_sessions(engine_id)

    def lines(self, session: dict) -> list[str]:
        """One endpoint's status in words."""
        from shmtier.shared.segment import human_bytes

        p = session
        state = "alive" if p.get("alive") else "GONE"
        parked = p.get("parked") or {}
        lines = [f"p2p    endpoint {p.get('endpoint')} pid {p.get('pid')} {state} "
                 f"(status {p.get('age_s', 0):.1f}s old)"
                 f"{'  PLAINTEXT' if p.get('plaintext') else ''}"
                 f"  parked {parked.get('rows', 0)} rows of {parked.get('requests', 0)} requests"]
        for i in p.get("inbound") or []:
            refused = f"  REFUSED {i['refused']}" if i.get("refused") else ""
            lines.append(f"  in  {i.get('name')}  sent {human_bytes(i.get('bytes_sent', 0))}"
                         f"{refused}")
        for o in p.get("outbound") or []:
            lines.append(f"  out {o.get('peer')}  circuit {o.get('circuit')}  failures "
                         f"{o.get('failures', 0)}  chunks {o.get('chunks', 0)}  received "
                         f"{human_bytes(o.get('bytes_received', 0))}"
                         + (f"  last error {o['last_error']}" if o.get("last_error") else ""))
        return lines
