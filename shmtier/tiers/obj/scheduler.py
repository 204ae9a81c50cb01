"""``obj``: the scheduler half of the object-storage tier (the worker half is
``shmtier.tiers.obj.backend``: boto3 against any S3-compatible store).

Who calls: the tiering manager, in the scheduler process, under its lock. Everything
but the names is the storage tiers' scheduler half
(``shmtier/storage/scheduler.py``: index, ``max_bytes`` with LRU deletes,
lookup probes of a shared bucket (HEAD per key, in the workers), job batching): no
request to the object store is ever made from the scheduler process after the spec's
start-up check (``shmtier/tiers/obj/client.py``).
"""

from __future__ import annotations

from shmtier.storage.scheduler import StorageTierManager

BYTES_STORED = "vllm:kv_offload_shmtier_obj_bytes_stored"
EVICTED_CHUNKS = "vllm:kv_offload_shmtier_obj_evicted_chunks"


class ObjTierManager(StorageTierManager):
    """The scheduler half of ``obj``; its options are a validated ``ObjTierConfig``
    (``shmtier/tiers/obj/config.py`` documents each)."""

    kind = "obj"
    BYTES_METRIC = BYTES_STORED
    BYTES_HELP = "Bytes the obj tier holds in its bucket (frames)."
    EVICTED_METRIC = EVICTED_CHUNKS
    MAX_BYTES_INFO = "obj_max_bytes"

    def medium_words(self) -> str:
        return self.config.where_words()
