"""Canonical, block-level description of a GPU worker's KV caches (vLLM-free).

Runs in: GPU worker processes (vLLM's worker, or a test/bench process that
plays one). Nothing here blocks.

vLLM 0.33 hands an offloading worker a ``CanonicalKVCaches`` built by its
connector's ``register_kv_caches`` (docs/vllm-contract.md §2.4): a list of unique KV tensors,
each viewable as int8 ``(num_blocks, page_bytes)``, and for every KV-cache group
the list of references (one per layer or group of layers) saying which tensor
the group's layers live in and how many bytes of each block page they actually
use. The classes below carry the same attribute names as vLLM's
(``tensors``, ``group_data_refs``; ``tensor`` / ``page_size_bytes``;
``tensor_idx`` / ``page_size_bytes`` / ``mapping``), so the copy worker accepts
either these or vLLM's own objects (duck typing), and shmtier itself never
imports vLLM.

``CanonicalKVCaches.tensors`` entries may be a :class:`CanonicalKVCacheTensor`
(vLLM's form: any dtype/shape whose leading dimension is the block) or, as a
shorthand, a bare tensor already shaped ``(num_blocks, page_bytes)`` int8 whose
page size is its second dimension. :func:`block_tensors` turns either into the
int8 2-D views the copy worker indexes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CanonicalKVCacheTensor:
    """One unique KV tensor: leading dimension = blocks; ``page_size_bytes``
    = (possibly padded) bytes of one block."""

    tensor: torch.Tensor
    page_size_bytes: int


@dataclass(frozen=True)
class CanonicalKVCacheRef:
    """One layer's (or layer group's) use of tensor ``tensor_idx``.

    ``page_size_bytes`` is the layer's *unpadded* page: only that many leading
    bytes of each block are copied. ``mapping`` is vLLM's canonical-layout page
    mapping; the direct layout shmtier uses ignores it.
    """

    tensor_idx: int
    page_size_bytes: int
    mapping: Any = None


@dataclass
class CanonicalKVCaches:
    """The unique tensors plus, per KV-cache group, the refs into them."""

    tensors: list[Any] = field(default_factory=list)
    group_data_refs: list[list[Any]] = field(default_factory=list)


def block_tensors(kv_caches: Any) -> list[torch.Tensor]:
    """Int8 ``(num_blocks, page_bytes)`` views of ``kv_caches.tensors`` (no copy).

    Accepts shmtier's or vLLM's ``CanonicalKVCaches``. Raises ``ValueError``
    naming the tensor when one cannot be viewed that way.
    """
    views = []
    for idx, entry in enumerate(kv_caches.tensors):
        if isinstance(entry, torch.Tensor):
            tensor, page = entry, None
        else:
            tensor, page = entry.tensor, int(entry.page_size_bytes)
        if tensor.dtype == torch.int8 and tensor.dim() == 2 and (
            page is None or page == tensor.shape[1]
        ):
            if tensor.stride(1) != 1:
                raise ValueError(f"kv tensor {idx}: block pages must be contiguous")
            views.append(tensor)
            continue
        if tensor.dim() == 0 or tensor.shape[0] == 0:
            raise ValueError(f"kv tensor {idx}: needs a leading block dimension")
        if page is None:
            page = tensor.numel() * tensor.element_size() // tensor.shape[0]
        try:
            views.append(tensor.view(torch.int8).view(-1, page))
        except RuntimeError as exc:
            raise ValueError(
                f"kv tensor {idx} (shape {tuple(tensor.shape)}, dtype {tensor.dtype}) "
                f"cannot be viewed as int8 (num_blocks, {page}): {exc}"
            ) from exc
    return views
