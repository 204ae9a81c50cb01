"""``fs`` tier options (any process): what ``secondary_tiers[i]`` of type ``fs`` accepts.

Checked when the spec is built, so a missing, non-directory or read-only
``root_dir``, a string for a boolean or a ``max_bytes`` too small for one chunk
fails there, naming the key, before any tier worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmtier.options import boolean, integer, one_of, writable_dir
from shmtier.tiers.config import REQUIRED, option
from shmtier.tiers.storage.config import StorageTierConfig

#: O_DIRECT writes a tier worker keeps in flight by default (``write_depth``), and the most.
DEFAULT_WRITE_DEPTH = 8
MAX_WRITE_DEPTH = 64

DEFAULT_MIN_FREE_BYTES = 1 << 30


@dataclass(frozen=True, kw_only=True)
class FsTierConfig(StorageTierConfig):
    """``root_dir``: an existing, writable directory (the tier keeps its files in a
    namespace subdirectory per layout; engines of one layout may share it: DP replicas,
    restarts, NFS). ``max_bytes`` and the options of every storage tier (locality,
    events, pinning, ``probe_unknown``/``probe_ttl_s``/``probe_timeout_s`` for a shared
    root): ``StorageTierConfig``. ``min_free_bytes``: free space the workers
    leave on the filesystem (None: none). ``fsync``: fsync each file before publishing
    it. ``direct_io``: False (the default: buffered both ways), "writes" (stores with
    O_DIRECT where the filesystem takes it, loads buffered), "auto" (O_DIRECT both ways
    where the filesystem takes it) or True (both ways, required); bench/README.md,
    "Writes that miss the page cache", has the measurements. ``write_depth``: O_DIRECT
    writes a tier worker keeps in flight, each with a chunk-sized buffer.
    ``page_cache_bytes``: with buffered stores, the bytes of a tier worker's most recent
    files left in the page cache; older ones are written back and dropped from it
    (``writeback.py``; None: no limit, the kernel's choice; "auto", the default: no
    limit until the worker's buffered writes show new page cache to be expensive, then
    what it holds).
    ``n_read_threads``/``n_write_threads``: vLLM's fs options, accepted and unused (the
    tier workers do the I/O).

    ``mac_key_file`` / ``mac_key``: ``StorageTierConfig``."""

    frame_word = "file"

    root_dir: str = option(REQUIRED, writable_dir(), worker=True)
    min_free_bytes: int | None = option(DEFAULT_MIN_FREE_BYTES,
                                        integer(0).or_none("null (no floor)"), worker=True)
    fsync: bool = option(False, boolean(), worker=True)
    direct_io: bool | str = option(False, one_of(False, True, "auto", "writes"), worker=True)
    write_depth: int = option(DEFAULT_WRITE_DEPTH, integer(1, MAX_WRITE_DEPTH), worker=True)
    page_cache_bytes: int | str | None = option(
        "auto", integer(1).or_none("null (no limit)").or_text(
            "auto", "bounded once new page cache proves expensive"), worker=True)
    n_read_threads: int | None = option(None, integer(1).or_none())
    n_write_threads: int | None = option(None, integer(1).or_none())
