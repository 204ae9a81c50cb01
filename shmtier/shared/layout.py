"""Geometry of a segment: how many rows, how wide, and where each area starts.

Arena rows follow vLLM 0.33's SharedOffloadRegion exactly (docs/vllm-contract.md §4): a row
holds one chunk for every GPU rank; rank ``w`` owns bytes
``[w * page_size_per_worker, (w + 1) * page_size_per_worker)`` of the row and
the row stride is that total rounded up to the OS page size.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from shmtier.shared.chunk_table import control_nbytes

PAGE_SIZE = mmap.PAGESIZE
HUGE_PAGE_SIZE = 2 << 20
HEADER_SIZE = 4096
#: The header page's second half is the scheduler's statistics area (segment layout
#: version 2; ``shmtier/shared/stats_area.py``); the first holds the header fields and the
#: fingerprint text.
STATS_OFFSET = 2048
STATS_SIZE = HEADER_SIZE - STATS_OFFSET
DEFAULT_KEY_WIDTH = 40  # a 32-byte block hash + 4-byte group index, 8-byte aligned


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class ArenaGeometry:
    """Row geometry of the arena; identical in every process of one engine."""

    num_chunks: int
    row_stride: int  # bytes per row, a multiple of PAGE_SIZE
    page_size_per_worker: int  # bytes of one GPU rank's slot in a row
    world_size: int  # slots per row (GPU ranks, or 1 with a replicated layout)
    key_width: int = DEFAULT_KEY_WIDTH

    def __post_init__(self) -> None:
        problems = []
        if self.num_chunks < 0:
            problems.append(f"num_chunks={self.num_chunks} (must be >= 0)")
        if self.world_size < 1:
            problems.append(f"world_size={self.world_size} (must be >= 1)")
        if self.row_stride % PAGE_SIZE:
            problems.append(
                f"row_stride={self.row_stride} (must be a multiple of the page size {PAGE_SIZE})"
            )
        if self.page_size_per_worker * self.world_size > self.row_stride:
            problems.append(
                f"page_size_per_worker={self.page_size_per_worker} x world_size="
                f"{self.world_size} exceeds row_stride={self.row_stride}"
            )
        if not 4 < self.key_width <= 255:
            problems.append(f"key_width={self.key_width} (must be in 5..255)")
        if problems:
            raise ValueError("invalid arena geometry: " + "; ".join(problems))

    @classmethod
    def for_kv(
        cls,
        *,
        cpu_bytes_to_use: int,
        worker_kv_bytes_per_block: int,
        blocks_per_chunk: int,
        world_size: int,
        replicated_layout: bool = False,
        key_width: int = DEFAULT_KEY_WIDTH,
    ) -> "ArenaGeometry":
        """The geometry vLLM's CPU/tiering spec derives (docs/vllm-contract.md §1.9, CPU sizing)."""
        num_copies = 1 if replicated_layout else world_size
        raw_bytes_per_chunk = worker_kv_bytes_per_block * num_copies * blocks_per_chunk
        if raw_bytes_per_chunk == 0:
            return cls(0, 0, 0, num_copies, key_width)
        row_stride = round_up(raw_bytes_per_chunk, PAGE_SIZE)
        return cls(
            num_chunks=cpu_bytes_to_use // row_stride,
            row_stride=row_stride,
            page_size_per_worker=raw_bytes_per_chunk // num_copies,
            world_size=num_copies,  # slots per row: one when every rank holds the same KV
            key_width=key_width,
        )


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets of the areas: header (its second half: the stats area, at
    ``STATS_OFFSET``) | control | rings | arena."""

    geometry: ArenaGeometry
    control_off: int
    control_len: int
    rings_off: int
    rings_len: int
    arena_off: int
    arena_len: int
    total_len: int

    @classmethod
    def for_geometry(cls, geometry: ArenaGeometry, rings_len: int = 0) -> "SegmentLayout":
        control_off = HEADER_SIZE
        control_len = round_up(control_nbytes(geometry.num_chunks, geometry.key_width), PAGE_SIZE)
        rings_off = control_off + control_len
        rings_len = round_up(rings_len, PAGE_SIZE)
        arena_len = geometry.num_chunks * geometry.row_stride
        # 2 MiB alignment lets the kernel back big arenas with huge pages.
        align = HUGE_PAGE_SIZE if arena_len >= HUGE_PAGE_SIZE else PAGE_SIZE
        arena_off = round_up(rings_off + rings_len, align)
        return cls(
            geometry=geometry,
            control_off=control_off,
            control_len=control_len,
            rings_off=rings_off,
            rings_len=rings_len,
            arena_off=arena_off,
            arena_len=arena_len,
            total_len=arena_off + arena_len,
        )
