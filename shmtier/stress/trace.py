"""The stress run's workload: multi-turn conversations whose chunk keys and bytes are a
function of the conversation and position alone, so any process (the run, its warm-restart
child, a check) can say what a key's chunk must hold without shared state.

Pure: no I/O, no blocking; called from the run's scheduler thread.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

PAGE = 64 << 10  # bytes of one GPU block (one rank); bf16 KV of a small model


@dataclass
class Conversation:
    cid: int
    chunks: int = 0


def chunk_keys(cid: int, n: int) -> list[bytes]:
    """The first ``n`` chunk keys of conversation ``cid`` (a hash chain, as a prefix is)."""
    keys, parent = [], f"conv{cid}".encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        keys.append(parent + b"\0\0\0\0")
    return keys


def content(key: bytes) -> np.ndarray:
    """Deterministic bf16-like KV bytes of one chunk (random normal, top 16 bits)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return (rng.standard_normal(PAGE // 2, dtype=np.float32).view(np.uint32) >> 16).astype(
        np.uint16).view(np.uint8)


def plan(conversations: int, turns: int, seed: int) -> list[int]:
    """The request order: every conversation once per turn, shuffled per turn (seeded)."""
    rng = np.random.default_rng(seed)
    return [c for _ in range(turns) for c in rng.permutation(conversations).tolist()]
