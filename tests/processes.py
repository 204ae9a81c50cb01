"""Test helper: find live processes by command line (read from /proc)."""

from __future__ import annotations

import os


def worker_processes(engine_id: str) -> list[int]:
    """Pids of running tier worker processes of ``engine_id``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"shmtier.workers.job_loop" in argv and engine_id.encode() in argv:
            found.append(int(entry))
    return found
