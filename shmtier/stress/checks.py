"""The stress run's end checks: once the tiers settle, the fs tier's index (and its bytes
gauge) against the files on disk, the damaged files the tier never read again against what
``shmtier fsck --verify`` finds, and a fresh engine's start-up scan of the same root.

Who calls: ``run_stress`` on its scheduler thread after the trace; ``fresh_scan`` after the
run's engine shut down. Blocks on the filesystem (a walk of the root) and, in
``fresh_scan``, on the fresh engine's listing (bounded).
"""

from __future__ import annotations

import os
import uuid

from shmtier.connector_driver import ConnectorDriver
from shmtier.stress import faults
from shmtier.stress.verdict import StressResult
from shmtier.tiers.fs import scheduler as fs_tier

def files(root: str) -> tuple[dict[bytes, int], int]:
    """The ``*.kv`` chunk files under ``root`` (key -> size) and the number of temp files."""
    from shmtier.tiers.fs.namespace import chunk_key

    found, temps = {}, 0
    for where, _, names in os.walk(root):
        for name in names:
            key = chunk_key(name) if name.endswith(".kv") else None
            if key is not None:
                found[key] = os.lstat(os.path.join(where, name)).st_size
            elif name.endswith(".tmp"):
                temps += 1
    return found, temps


def damaged_left(corrupted: list) -> dict[bytes, str]:
    """Of the files the run damaged (``[path, identity, how]``), those still at their
    path (nobody read, removed or replaced them): key -> path."""
    from shmtier.tiers.fs.namespace import chunk_key

    return {chunk_key(os.path.basename(path)): path for path, ident, _ in corrupted
            if faults.still_there(path, ident)}


def big_left(big: list) -> dict[bytes, str]:
    """Of the files the run made too big for any chunk (``[path, identity]``), those still
    at their path: key -> path."""
    from shmtier.tiers.fs.namespace import chunk_key

    return {chunk_key(os.path.basename(path)): path for path, ident in big
            if faults.still_there(path, ident)}


def check_index(result: StressResult, root: str, who: str, indexed: dict[bytes, int],
                gauge: int, max_bytes: int | None, temps_allowed: bool = True,
                damaged: dict[bytes, str] | None = None,
                foreign: dict[bytes, str] | None = None) -> None:
    """The fs index (and its bytes gauge) against the files on disk. ``damaged``: files
    the run damaged and the tier never read since (a cut one is smaller than its index
    entry): left out of the size comparisons, named in the line. ``foreign``: files the
    run made too big for any chunk (``big_left``) that no op of the tier met since: no
    chunk at all, left out of every comparison (an index entry of the chunk they replaced
    too), named in the line."""
    on_files, temps = files(root)
    damaged = damaged or {}
    away = (foreign or {}).keys() & on_files.keys()
    if away:
        on_files = {k: v for k, v in on_files.items() if k not in away}
        gauge -= sum(indexed[k] for k in away if k in indexed)
        indexed = {k: v for k, v in indexed.items() if k not in away}
    apart = damaged.keys() & on_files.keys() & indexed.keys()
    on_disk = sum(on_files.values())
    diff = (gauge - sum(indexed[k] for k in apart)) - (on_disk - sum(on_files[k] for k in apart))
    orphans = on_files.keys() - indexed.keys()
    missing = indexed.keys() - on_files.keys()
    sized = [k for k in on_files.keys() & indexed.keys() - apart if on_files[k] != indexed[k]]
    but = f"; {len(apart)} damaged files never read again left out" if apart else ""
    if away:
        but += f"; {len(away)} files too big for a chunk, never met again, left out"
    result.check(f"{who}: bytes", diff == 0,
                 f"{who}: fs bytes_on_disk gauge {gauge} vs *.kv files {on_disk} "
                 f"({len(on_files)} files, {len(indexed)} indexed{but}): diff {diff:+d}",
                 gauge=gauge, on_disk=on_disk, files=len(on_files), indexed=len(indexed))
    result.check(f"{who}: orphans", not orphans,
                 f"{who}: orphan files (on disk, not indexed): {len(orphans)} "
                 f"({sum(on_files[k] for k in orphans)} bytes)", orphans=len(orphans))
    result.check(f"{who}: missing files", not missing and not sized,
                 f"{who}: indexed chunks without a file: {len(missing)}; size differs: "
                 f"{len(sized)}", missing=len(missing), size_differs=len(sized),
                 missing_keys=sorted(k.hex() for k in missing)[:16],
                 sized_keys=sorted(k.hex() for k in sized)[:16])
    if max_bytes is not None:
        result.check(f"{who}: max_bytes", on_disk <= max_bytes,
                     f"{who}: files within max_bytes: {on_disk} <= {max_bytes}",
                     on_disk=on_disk, max_bytes=max_bytes)
    result.check(f"{who}: temp files", temps_allowed or temps == 0,
                 f"{who}: temp files left: {temps}", temps=temps)


def check_damaged(result: StressResult, root: str, corrupted: list, detected: int) -> None:
    """After the run: every damaged file still on disk is what ``shmtier fsck --verify``
    finds corrupt or truncated (and it finds nothing else so); they are removed with
    ``--repair`` for the fresh engine. The tier counted at most what was damaged."""
    from shmtier.tiers.fs.fsck import fsck_root

    left = damaged_left(corrupted)
    report = fsck_root(root, verify=True, repair={"corrupt", "truncated"})
    bad = {os.path.join(report.target, p.path) for p in report.problems
           if p.kind in ("corrupt", "truncated")}
    real = {os.path.realpath(path) for path in left.values()}
    gone = len(corrupted) - len(left)
    result.check("damaged files accounted", bad == real and detected <= len(corrupted),
                 f"damaged chunk files: {len(corrupted)}; detected by the tier on load "
                 f"(checksum_failures) {detected}; still on disk, never read again {len(left)}, "
                 f"fsck --verify finds {len(bad)} corrupt (the same: "
                 f"{'yes' if bad == real else 'NO'}), removed; evicted, deleted or "
                 f"replaced otherwise {max(0, gone - detected)}",
                 damaged=len(corrupted), detected=detected, left=len(left), fsck_found=len(bad))


def fresh_scan(result: StressResult, extra: dict, layout, root: str,
               max_bytes: int | None) -> None:
    """After shutdown: a second engine on the same root lists it at start-up; its index
    must be exactly the files (and the scan removes dead writers' temp files)."""
    from shmtier.spec import TieringOffloadingSpec

    spec = TieringOffloadingSpec(extra, layout, f"run-{uuid.uuid4().hex[:8]}")
    manager = spec.get_manager()
    try:
        settled = ConnectorDriver(manager).settle(30.0, sleep_s=0.002) is not None
        with manager.lock:
            stats = manager.get_stats()
            gauge = sum(stats.data["data"].get(fs_tier.BYTES_ON_DISK, {}).values())
            fs = next(t for t in manager.tiers if isinstance(t, fs_tier.FsTierManager))
            indexed = fs.indexed_chunks()
        result.check("fresh engine settled", settled,
                     f"fresh engine on the same root: start-up scan done: "
                     f"{'yes' if settled else 'NO'}")
        check_index(result, root, "fresh engine", indexed, gauge, max_bytes,
                    temps_allowed=False)
    finally:
        manager.shutdown()
        left = [e for e in os.listdir("/dev/shm") if spec.engine_id in e]
        if left:
            result.check("fresh engine cleaned up", False, f"fresh engine left {left} in /dev/shm")
