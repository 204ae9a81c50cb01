"""vLLM 0.34's pre-resolved device pointers, turned back into block ids (vLLM-free).

Runs in: GPU worker processes, inside :meth:`BlockCopyWorker.submit_store` /
``submit_load`` (the submitting thread). Nothing here blocks or copies.

From vLLM 0.34 on, the connector's worker half no longer hands the offloading
worker the GPU side of a transfer as block ids (``GPULoadStoreSpec``): it
resolves them into addresses first and passes a ``DevicePointers``
(``submit_store(job_id, device_ptrs, dst_spec)``, ``submit_load(job_id,
src_spec, device_ptrs, expedited)``): flat ``ptrs`` / ``sizes`` (uint64, one
entry per copy op) ordered *for each group, for each data ref of the group, for each
block of the group*, plus per group ``group_block_counts``,
``group_data_ref_counts`` and ``block_indices`` (the logical index of the
group's first block, which fixes the skip into the first chunk exactly as a
``GPULoadStoreSpec``'s ``block_indices`` do, docs/vllm-contract.md §5).

:func:`blocks_from_pointers` checks such an object against the worker's KV
caches and gives back, per group and per ref, the block ids the pointers
address, so one planner (``BlockCopyWorker._plan``) serves both shapes and the
copies land at exactly the given addresses. Duck typed: any object with the
five attributes is accepted (:func:`is_device_pointers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

POINTER_FIELDS = ("ptrs", "sizes", "group_block_counts", "group_data_ref_counts",
                  "block_indices")


def is_device_pointers(obj: Any) -> bool:
    """True when ``obj`` carries every attribute of vLLM's ``DevicePointers``."""
    return all(hasattr(obj, name) for name in POINTER_FIELDS)


@dataclass
class PointerBlocks:
    """The GPU side of one transfer, as the planner consumes it.

    ``ref_blocks[g][r]``: int64 block ids of tensor ``group_refs[g][r]``'s
    tensor, one per block of group ``g`` (empty lists for empty groups).
    """

    group_sizes: list[int]
    block_indices: list[int]
    ref_blocks: list[list[np.ndarray]]


def _uint64_array(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if array.ndim != 1 or array.dtype.kind not in "ui":
        raise ValueError(f"device pointers: {name} must be a 1-D integer array (uint64), "
                         f"got dtype {array.dtype} shape {array.shape}")
    if array.dtype.kind == "i" and (array < 0).any():
        raise ValueError(f"device pointers: {name} holds negative values")
    return array.astype(np.uint64, copy=False)


def _first(mask: np.ndarray, g: int, refs: list[tuple[int, int]]) -> tuple[int, int, str]:
    """(ref, block) of the first True in group ``g``'s (refs, blocks) mask, and
    the words that name that ref in an error."""
    r, k = (int(i) for i in np.argwhere(mask)[0])
    return r, k, f"group {g} data ref {r} (kv tensor {refs[r][0]})"


def blocks_from_pointers(
    pointers: Any,
    blocks: list[torch.Tensor],
    group_refs: list[list[tuple[int, int]]],
) -> PointerBlocks:
    """Validate ``pointers`` (a ``DevicePointers``) and map them to block ids.

    ``blocks``: the worker's int8 ``(num_blocks, page)`` tensor views;
    ``group_refs``: per group, ``(tensor_idx, unpadded page bytes)`` per ref.
    Raises ``ValueError`` naming the group, ref and value when the group or
    data-ref counts differ from the KV caches', the array lengths do not match
    them, a size is not that ref's unpadded page, or a pointer lies outside
    that ref's tensor or off one of its block boundaries.
    """
    try:
        counts = [int(n) for n in pointers.group_block_counts]
        ref_counts = [int(n) for n in pointers.group_data_ref_counts]
        indices = [int(i) for i in pointers.block_indices]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"device pointers: group_block_counts, group_data_ref_counts and "
                         f"block_indices must be sequences of ints ({exc})") from None
    num_groups = len(group_refs)
    if not len(counts) == len(ref_counts) == len(indices) == num_groups:
        raise ValueError(
            f"device pointers describe {len(counts)} group block counts, {len(ref_counts)} "
            f"data-ref counts and {len(indices)} block indices, but the KV caches have "
            f"{num_groups} groups")
    for g, (size, n_refs) in enumerate(zip(counts, ref_counts)):
        if n_refs != len(group_refs[g]):
            raise ValueError(f"group {g}: device pointers carry {n_refs} data refs per "
                             f"block, but the KV caches' group {g} has {len(group_refs[g])}")
        if size < 0:
            raise ValueError(f"group {g}: group_block_counts={size} (need >= 0)")

    ptrs = _uint64_array(pointers.ptrs, "ptrs")
    sizes = _uint64_array(pointers.sizes, "sizes")
    need = sum(size * n_refs for size, n_refs in zip(counts, ref_counts))
    if len(ptrs) != need or len(sizes) != need:
        raise ValueError(
            f"device pointers carry {len(ptrs)} ptrs and {len(sizes)} sizes, but group block "
            f"counts {counts} x data refs {ref_counts} need {need} of each")

    # Per tensor: first block address, block stride, end of its last block.
    bases = np.array([t.data_ptr() for t in blocks], dtype=np.uint64)
    strides = np.array([t.stride(0) * t.element_size() for t in blocks], dtype=np.uint64)
    ends = bases + strides * np.array([t.shape[0] for t in blocks], dtype=np.uint64)

    ref_blocks: list[list[np.ndarray]] = []
    op = 0
    for g, size in enumerate(counts):
        if size == 0:
            ref_blocks.append([])
            continue
        refs = group_refs[g]
        n = len(refs) * size
        # (ref, block) grids, vectorised over the group's refs
        tensors = np.array([t for t, _ in refs], dtype=np.int64)
        unpadded = np.array([nbytes for _, nbytes in refs], dtype=np.uint64)[:, None]
        grid_ptrs = ptrs[op:op + n].reshape(len(refs), size)
        grid_sizes = sizes[op:op + n].reshape(len(refs), size)
        base, row, end = (a[tensors][:, None] for a in (bases, strides, ends))

        wrong = grid_sizes != unpadded
        if wrong.any():
            r, k, at = _first(wrong, g, refs)
            raise ValueError(
                f"{at}: copy sizes must equal the ref's unpadded page of {refs[r][1]} bytes, "
                f"got {int(grid_sizes[r, k])} for block {k} ({int(wrong.sum())} of {n} "
                f"copies in the group differ)")
        outside = (grid_ptrs < base) | (grid_ptrs >= end)
        if outside.any():
            r, k, at = _first(outside, g, refs)
            raise ValueError(
                f"{at}: device pointer {int(grid_ptrs[r, k]):#x} of block {k} lies outside the "
                f"tensor's blocks [{int(base[r, 0]):#x}, {int(end[r, 0]):#x}) "
                f"({int(outside.sum())} of {n} pointers in the group do)")
        offsets = grid_ptrs - base
        past = offsets % row
        if past.any():
            r, k, at = _first(past != 0, g, refs)
            raise ValueError(
                f"{at}: device pointer {int(grid_ptrs[r, k]):#x} of block {k} is "
                f"{int(past[r, k])} bytes past a block boundary of the tensor (block "
                f"stride {int(row[r, 0])} bytes)")
        ref_blocks.append(list((offsets // row).astype(np.int64)))
        op += n
    return PointerBlocks(counts, indices, ref_blocks)
