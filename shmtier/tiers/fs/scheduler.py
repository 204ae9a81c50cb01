"""``fs``: the scheduler half of the filesystem tier (the worker half is
``shmtier.tiers.fs.backend``).

Who calls: the tiering manager, in the scheduler process, under its lock. Everything
but the names is the storage tiers' scheduler half
(``shmtier/storage/scheduler.py``: index, capacity, eviction, lookup probes of a
shared root, job batching): this module says what the medium is called and which
metrics the tier reports.
"""

from __future__ import annotations

from shmtier.storage.scheduler import StorageTierManager
from shmtier.storage.tier_metrics import (
    CODEC_SECONDS,
    CORRUPT_CHUNKS,
    POOL_BROKEN,
    PROBE_HITS,
    PROBED_KEYS,
    PROBES_EXPIRED,
    RING_DEPTH,
    STORED_RATIO,
    WORKER_RESTARTS,
    WORKERS_LATE_BUT_BUSY,
)
from shmtier.storage.transfers import MAX_COMBINED_KEYS

BYTES_ON_DISK = "vllm:kv_offload_shmtier_fs_bytes_on_disk"
EVICTED_CHUNKS = "vllm:kv_offload_shmtier_fs_evicted_chunks"

__all__ = ["FsTierManager", "BYTES_ON_DISK", "EVICTED_CHUNKS", "CODEC_SECONDS",
           "CORRUPT_CHUNKS", "MAX_COMBINED_KEYS", "PROBE_HITS", "PROBED_KEYS",
           "PROBES_EXPIRED", "STORED_RATIO", "WORKER_RESTARTS", "WORKERS_LATE_BUT_BUSY",
           "POOL_BROKEN", "RING_DEPTH"]


class FsTierManager(StorageTierManager):
    """The scheduler half of ``fs``; its options are a validated ``FsTierConfig``
    (``shmtier/tiers/fs/config.py`` documents each)."""

    kind = "fs"
    BYTES_METRIC = BYTES_ON_DISK
    BYTES_HELP = "Bytes the fs tier holds on disk (frames)."
    EVICTED_METRIC = EVICTED_CHUNKS
    MAX_BYTES_INFO = "fs_max_bytes"

    def medium_words(self) -> str:
        return f"the filesystem of {self.config.root_dir}"
