"""Tier configurations and tier-level steps shared by the e2e scenarios.

``fs_tier`` / ``obj_tier`` build ``secondary_tiers`` entries; ``wait_stable`` waits
until a count (files under a root, objects in a bucket) stops changing, i.e. the
cascades of what a server just computed have landed; ``corrupt_kv_files`` damages chunk
files; ``probe_tiers`` asks one prompt cold, then from the CPU tier, then from the fs
tier, asserting from /metrics which tier served it and adding its times to the report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from .e2e_chats import flush
from .e2e_metrics import CPU_TIER, DEVICE_HIT_TOKENS, Metrics, assert_tier_served
from .e2e_server import BLOCK_SIZE, GPU_BLOCKS

#: CPU tier rows of the scenarios' servers: more than a device cache, fewer than a
#: conversation round plus the fillers that push it out (so the fs tier gets to serve).
CPU_ROWS = 48
#: filler blocks that push everything out of the device cache (but not of the CPU tier)
FLUSH_DEVICE = GPU_BLOCKS + 4
#: ... and out of the CPU tier too
FLUSH_CPU = GPU_BLOCKS + CPU_ROWS + 8


def fs_tier(root: str, **kw) -> dict:
    return {"type": "fs", "root_dir": root, "min_free_bytes": None, **kw}


def obj_tier(s3, bucket: str, **kw) -> dict:
    return {"type": "obj", "store_config": s3.store_config(bucket), **kw}


def kv_files(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.join(dirpath, n) for n in names if n.endswith(".kv")]
    return out


def wait_stable(count: Callable[[], int], *, at_least: int = 1, quiet_s: float = 1.0,
                timeout_s: float = 30.0) -> int:
    """Wait until ``count()`` is at least ``at_least`` and has not changed for
    ``quiet_s``; return it. AssertionError at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif now >= at_least and time.monotonic() - since >= quiet_s:
            return now
    raise AssertionError(f"count still {last} (wanted >= {at_least}, stable for "
                         f"{quiet_s}s) after {timeout_s}s")


def corrupt_kv_files(paths: list[str]) -> int:
    """Flip bytes in the middle of each file (the payload: its CRC no longer matches)."""
    for p in paths:
        with open(p, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(size // 2)
            chunk = f.read(64)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
    return len(paths)


def probe_tiers(cmp, server, prompts, report, scenario: str, tag: str,
                fs: str | None = "1:fs") -> list:
    """One new prompt of 12 blocks asked four times: cold; after the device cache was
    flushed (the CPU tier serves it); after the CPU tier was flushed too (``fs``
    serves it, when given); then again (the device cache). Each step asserts from
    /metrics which tier served it. Returns the messages (to ask again later)."""
    q = [prompts.user(f"{tag}-probe", 12 * BLOCK_SIZE + 8)]

    def timed(served_by: str):
        before = Metrics.scrape(server)
        a = cmp.ask(server, q, label=f"probe {tag} ({served_by})")
        d = Metrics.scrape(server) - before
        report.ttft(scenario, served_by, a)
        return d

    timed("none (cold)")
    flush(cmp, server, prompts, FLUSH_DEVICE)
    assert_tier_served(timed(CPU_TIER), CPU_TIER, f"{tag}: probe after a device flush")
    if fs is not None:
        flush(cmp, server, prompts, FLUSH_CPU)
        assert_tier_served(timed(fs), fs, f"{tag}: probe after a CPU tier flush")
    d = timed("device")
    assert d.value(DEVICE_HIT_TOKENS) > 0, f"{tag}: the probe asked again was no device hit"
    return q
