"""The worker half of the ``node`` tier: copies chunks between this engine's arena rows
and the node pool's rows.

Runs in: tier worker processes only, called by the job loop for one job at a time on
the worker's main thread. A call blocks on the pool's lock (``fcntl.flock``: held by
another engine's worker for a few list and index updates, never across a copy) and
copies memory; nothing else. Imports neither torch nor vLLM.

The pool is mapped at the first job, not at ``open``: the tier workers start before the
scheduler half has attached (and, as the first engine, created) the pool. Every copy and
check is the pool's (``NodePool.store_many``/``load_many``: reserve, copy outside the
lock, CRC, publish; pin, copy out, verify, unpin); this module turns its outcomes into
the job's per-key results.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from shmtier.tiers.backend import (
    BatchResult,
    Outcome,
    ScanEntry,
    TierBackend,
    WorkerContext,
    as_arena,
    check_batch,
    row_problem,
)
from shmtier.tiers.node.config import NodeTierConfig


class NodeBackend(TierBackend):
    """Stores (arena row -> pool) and loads (pool -> arena row) for one engine's node
    tier; ``probe`` answers whether the pool holds a key now. No ``delete`` or ``scan``:
    the pool evicts by its own LRU, and lookups read its index directly."""

    HANDLERS = {"store": "store", "load": "load", "probe": "probe"}

    def __init__(self, config: NodeTierConfig, context: WorkerContext):
        if config.pool is None:  # the spec resolves it (TierContext.engine_id)
            raise ValueError("node tier: the pool config reached the worker without a pool "
                             "name")
        self.config = config
        self.context = context
        self._node: Any = None

    @classmethod
    def open(cls, config: NodeTierConfig, context: WorkerContext) -> "NodeBackend":
        return cls(config, context)

    @property
    def node(self) -> Any:
        """The pool, mapped on first use (without an engine-table entry: this worker's
        pins and writes carry its own pid)."""
        if self._node is None:
            from shmtier.tiers.node.pool import NodePool

            self._node = NodePool.attach(
                self.config.pool, row_bytes=self.context.chunk_bytes,
                size_bytes=self.config.size_bytes, fingerprint=self.context.namespace,
                engine_id=self.context.engine_id, keep=self.config.keep, register=False)
        return self._node

    def _rows(self, op: str, keys: Sequence[bytes], rows: Sequence[int], arena,
              chunk_bytes: int) -> tuple[BatchResult, list[int], list]:
        """The batch checked: its result (INVALID where a row is out of range), the
        indices of the valid keys and their rows' payload views."""
        arena = as_arena(arena)
        check_batch(keys, rows, arena, chunk_bytes)
        res = BatchResult.empty(op, len(keys))
        valid, views = [], []
        for i, row in enumerate(rows):
            problem = row_problem(row, arena.shape[0])
            if problem is not None:
                res.set(i, Outcome.INVALID, problem)
                continue
            valid.append(i)
            views.append(memoryview(arena[row, :chunk_bytes]))
        return res, valid, views

    @staticmethod
    def _fill(res: BatchResult, valid: list[int], outcomes: Sequence[Outcome],
              details: dict[int, str], chunk_bytes: int, seconds: float) -> BatchResult:
        """Key ``valid[j]``'s outcome ``outcomes[j]`` with its detail (``details[j]``);
        the call's seconds shared by its keys; ``chunk_bytes`` moved for each OK key,
        held in the pool for each success (a store's EXISTS too)."""
        share = seconds / len(valid)
        for j, (i, outcome) in enumerate(zip(valid, outcomes)):
            res.set(i, outcome, details.get(j, ""))
            res.seconds[i] = share
            if outcome == Outcome.OK:
                res.logical_bytes[i] = chunk_bytes
            if res.ok(i):
                res.stored_bytes[i] = chunk_bytes
        return res

    def store(self, keys: Sequence[bytes], rows: Sequence[int], arena, chunk_bytes: int,
              **_ignored: Any) -> BatchResult:
        """Copy row ``rows[i]`` (first ``chunk_bytes``) into the pool under ``keys[i]``:
        OK (stored), EXISTS (the pool held it: nothing written), REJECTED (every pool row
        is pinned or being written), ERROR (the pool's lock), INVALID (a row out of range,
        a bad key)."""
        res, valid, views = self._rows("store", keys, rows, arena, chunk_bytes)
        if not valid:
            return res
        details: dict[int, str] = {}
        t0 = time.perf_counter()
        outcomes = self.node.store_many([keys[i] for i in valid], views, details)
        return self._fill(res, valid, outcomes, details, chunk_bytes, time.perf_counter() - t0)

    def load(self, keys: Sequence[bytes], rows: Sequence[int], arena,
             chunk_bytes: int) -> BatchResult:
        """Copy the pool's chunk of ``keys[i]`` into row ``rows[i]``, verified: OK, MISS
        (not in the pool: evicted since the lookup), CORRUPT (failed its CRC: dropped
        from the pool), ERROR (the pool's lock), INVALID. A row whose key is not OK holds
        undefined bytes."""
        res, valid, views = self._rows("load", keys, rows, arena, chunk_bytes)
        if not valid:
            return res
        details: dict[int, str] = {}
        t0 = time.perf_counter()
        outcomes = self.node.load_many([keys[i] for i in valid], views, details)
        return self._fill(res, valid, outcomes, details, chunk_bytes, time.perf_counter() - t0)

    def probe(self, keys: Sequence[bytes]) -> BatchResult:
        """OK where the pool holds the key now (READY), else MISS; reads its index."""
        res = BatchResult.empty("probe", len(keys))
        lookup = self.node.lookup
        for i, key in enumerate(keys):
            res.set(i, Outcome.OK if lookup(key) else Outcome.MISS)
        return res

    def delete(self, keys: Sequence[bytes]) -> BatchResult:
        raise NotImplementedError("the node pool evicts by its own LRU")

    def scan(self) -> Iterator[ScanEntry]:
        raise NotImplementedError("lookups read the node pool's index directly")

    def close(self) -> None:
        node, self._node = self._node, None
        if node is not None:
            node.close()
