"""Code that runs in GPU worker processes: the block copy worker (shmtier's
``OffloadingWorker``) and the canonical KV-cache description it consumes."""

from shmtier.gpu.canonical import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    block_tensors,
)
from shmtier.gpu.copy_worker import BlockCopyWorker

__all__ = [
    "BlockCopyWorker",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "block_tensors",
]
