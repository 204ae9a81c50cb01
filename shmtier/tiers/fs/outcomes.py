"""What the ``fs`` tier's worker half reports: its counters and per-key outcomes.

Runs in: tier worker processes, used by ``FsBackend`` (``backend.py``) and its write and
read paths (``store.py``, ``load.py``) on the worker's thread, and by the I/O threads of
``direct_writes.py`` (``errno_outcome``). Pure: nothing here
blocks or touches the filesystem. Per-key outcomes are ``shmtier.shared.jobs.Outcome``
members with a detail text (``shmtier.tiers.backend``).
"""

from __future__ import annotations

import errno
from dataclasses import asdict, dataclass, field

from shmtier.tiers.backend import Outcome

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def errno_outcome(exc: OSError, step: str) -> tuple[Outcome, str]:
    """REJECTED for out-of-space errnos, else ERROR; the detail names the errno, its
    text and the step, e.g. ``"ENOSPC No space left on device (write)"``."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, f"E{code}")
    text = exc.strerror or str(exc)
    return (Outcome.REJECTED if code in NO_SPACE else Outcome.ERROR), f"{name} {text} ({step})"


@dataclass
class FsCounters:
    """Counters of one FsBackend object (this process only; never reset by the backend).

    ``bytes_on_disk`` is what this process knows: set by a completed ``scan``, then
    adjusted by its own stores, deletes and corrupt-file removals, and zeroed when the
    namespace directory is found removed or replaced. Other processes
    writing the same namespace are not seen until the next scan; the scheduler half's
    index is the authoritative count."""

    bytes_on_disk: int = 0
    files_written: int = 0
    bytes_written: int = 0  # stored (on-disk) bytes of published files
    files_read: int = 0
    bytes_read: int = 0  # stored bytes read from verified files
    files_deleted: int = 0
    store_exists: int = 0
    store_full: int = 0
    store_errors: int = 0
    stores_raw_hurried: int = 0  # stored raw (mode "auto"): the worker behind, raw cheaper
    stores_raw_by_cost: int = 0  # stored raw (mode "auto"): a busy host, raw cheaper
    load_missing: int = 0
    load_errors: int = 0
    corrupt_files_detected: int = 0
    corrupt_files_removed: int = 0
    corrupt_remove_failed: int = 0  # detected, but the medium refused the unlink (e.g. EROFS)
    corrupt_by_reason: dict = field(default_factory=dict)
    temp_files_removed: int = 0
    misplaced_files_removed: int = 0  # chunk files in a directory their key does not map to
    # files at a chunk's name too large for any chunk of the layout (``load.chunk_file_cap``):
    # not ours, a MISS for every op; removed unless the medium refuses (or it was replaced)
    foreign_files_detected: int = 0
    foreign_files_removed: int = 0
    scan_errors: int = 0
    links_refused: int = 0  # symbolic links met where the layout has a file or directory
    namespace_resets: int = 0  # the namespace directory removed, replaced or made again

    def as_dict(self) -> dict:
        return asdict(self)
