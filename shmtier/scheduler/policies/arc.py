"""ARC as vLLM 0.33 implements it (docs/vllm-contract.md §3.7; differs from textbook ARC).

T1 holds chunks seen once, T2 chunks reused; B1/B2 remember keys recently
evicted from each. Inserts always go to T1 (and drop the key from B1/B2). A
request that *reuses* a ready chunk moves it T1 -> T2 when it finishes. A store
miss on a ghost key adapts the target size of T1 (``p``): a B1 hit grows it by
max(1, |B2|/|B1|), a B2 hit shrinks it by max(1, |B1|/|B2|). Eviction takes the
LRU evictable entry of T1 while the (simulated) T1 size is at least int(p),
else of T2, else of T1; each ghost list is then trimmed to the capacity.

State in the segment: per row its list (``plist``) and an order stamp; ghost
entries (key, list, stamp) in the ghost area; ``p`` in ``ARC_TARGET``. In
process: ordered dicts mirroring the four lists, rebuilt by sorting stamps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from shmtier.contract import OffloadKey, ReqContext
from shmtier.scheduler.policies.base import ChunkStatus, SegmentBackedPolicy, order_request_keys
from shmtier.shared.chunk_table import ARC_TARGET, B1, B2, NEXT_STAMP, T1, T2


class ARCCachePolicy(SegmentBackedPolicy):
    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.t1: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> row, LRU first
        self.t2: OrderedDict[OffloadKey, int] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> ghost slot
        self.b2: OrderedDict[OffloadKey, int] = OrderedDict()
        self._free_ghosts: list[int] = []

    def bind(self, table, rows) -> None:
        super().bind(table, rows)
        self._plist = table.plist
        self._stamp = table.stamp
        self._counters = table.counters
        self._floats = table.floats
        self._free_ghosts = list(range(table.num_ghosts - 1, -1, -1))

    @property
    def target_t1_size(self) -> float:
        return self._floats[ARC_TARGET]

    @target_t1_size.setter
    def target_t1_size(self, value: float) -> None:
        self._floats[ARC_TARGET] = value

    # --- bookkeeping mirrored into the table ---

    def _next_stamp(self) -> int:
        counters = self._counters
        counters[NEXT_STAMP] += 1
        return counters[NEXT_STAMP]

    def _to_mru(self, which: OrderedDict, key: OffloadKey, row: int, code: int) -> None:
        which[key] = row
        which.move_to_end(key)
        self._plist[row] = code
        self._stamp[row] = self._next_stamp()

    def _ghost_to_mru(self, which: OrderedDict, key: OffloadKey) -> None:
        which.move_to_end(key)
        self.table.ghost_stamp[which[key]] = self._next_stamp()

    def _add_ghost(self, which: OrderedDict, key: OffloadKey, code: int) -> None:
        # Trimming before appending keeps the same newest ``capacity`` keys as
        # vLLM's trim-after-batch, and never needs more than 2n ghost slots.
        if len(which) >= self.cache_capacity:
            self._drop_ghost(which, next(iter(which)))
        slot = self._free_ghosts.pop()
        self.table.write_ghost(slot, key, code, self._next_stamp())
        which[key] = slot

    def _drop_ghost(self, which: OrderedDict, key: OffloadKey) -> None:
        slot = which.pop(key, None)
        if slot is not None:
            self.table.ghost_list[slot] = 0
            self.table.ghost_key_len[slot] = 0
            self._free_ghosts.append(slot)

    def _adapt_to_ghost_hit(self, key: OffloadKey) -> None:
        if key in self.b1:
            delta = max(1, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + delta, self.cache_capacity)
            self._ghost_to_mru(self.b1, key)
        elif key in self.b2:
            delta = max(1, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0)
            self._ghost_to_mru(self.b2, key)

    # --- CachePolicy ---

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self._to_mru(self.t1, key, chunk.chunk_id, T1)
        self._drop_ghost(self.b1, key)
        self._drop_ghost(self.b2, key)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            self._adapt_to_ghost_hit(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        refcnt = self._refcnt
        for key in reversed(list(keys)):
            row = self.t1.get(key)
            if row is not None:
                if refcnt[row] < 0:  # just prepared for a store: not a second use
                    self._to_mru(self.t1, key, row, T1)
                else:
                    del self.t1[key]
                    self._to_mru(self.t2, key, row, T2)
            elif key in self.t2:
                self._to_mru(self.t2, key, self.t2[key], T2)
            else:
                self._adapt_to_ghost_hit(key)

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context) -> None:
        # Hot per request: the stamp counter lives in a local for the whole walk.
        t1, t2, stamp, plist = self.t1, self.t2, self._stamp, self._plist
        counters = self._counters
        next_stamp = counters[NEXT_STAMP]
        for key in reversed(order_request_keys(key_groups, req_context)):
            if key in insertion_only_keys:  # a store is not a frequency hit
                row = t1.get(key)
                if row is not None:
                    t1.move_to_end(key)
                else:
                    row = t2.get(key)
                    if row is None:
                        continue
                    t2.move_to_end(key)
            elif key in reused_keys:
                row = t1.pop(key, None)
                if row is not None:
                    t2[key] = row  # T1 -> T2 MRU
                    plist[row] = T2
                else:
                    row = t2.get(key)
                    if row is None:
                        continue
                    t2.move_to_end(key)
            else:
                continue
            next_stamp += 1
            stamp[row] = next_stamp
        counters[NEXT_STAMP] = next_stamp

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self._free_ghosts = list(range(self.table.num_ghosts - 1, -1, -1))
        self.target_t1_size = 0.0

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        refcnt = self._refcnt
        # Monotonic scans: restarting at the LRU end per victim would be quadratic.
        t1_iter = iter(self.t1.items())
        t2_iter = iter(self.t2.items())

        def next_candidate(entries):
            for key, row in entries:
                if refcnt[row] == 0 and key not in protected:
                    return key, row
            return None

        target = int(self.target_t1_size)
        virtual_t1 = len(self.t1)
        chosen: list[tuple[OffloadKey, int, bool]] = []  # (key, row, from_t1)
        for _ in range(n):
            entry = None
            if virtual_t1 >= target:
                entry = next_candidate(t1_iter)
                if entry is not None:
                    chosen.append((*entry, True))
                    virtual_t1 -= 1
                    continue
            entry = next_candidate(t2_iter)
            if entry is not None:
                chosen.append((*entry, False))
                continue
            entry = next_candidate(t1_iter)
            if entry is None:
                return None
            chosen.append((*entry, True))
            virtual_t1 -= 1

        victims = []
        for key, row, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self._add_ghost(self.b1, key, B1)
            else:
                del self.t2[key]
                self._add_ghost(self.b2, key, B2)
            self._plist[row] = 0
            victims.append((key, ChunkStatus(row, refcnt)))
        return victims

    def rebuild(self) -> None:
        table = self.table
        by_stamp = sorted(self.rows.items(), key=lambda kr: self._stamp[kr[1]])
        self.t1 = OrderedDict((k, r) for k, r in by_stamp if self._plist[r] == T1)
        self.t2 = OrderedDict((k, r) for k, r in by_stamp if self._plist[r] == T2)
        ghosts = sorted(
            (table.ghost_stamp[s], s) for s in range(table.num_ghosts) if table.ghost_list[s]
        )
        self.b1 = OrderedDict((table.read_ghost(s), s) for _, s in ghosts if table.ghost_list[s] == B1)
        self.b2 = OrderedDict((table.read_ghost(s), s) for _, s in ghosts if table.ghost_list[s] == B2)
        used = {s for _, s in ghosts}
        self._free_ghosts = [s for s in range(table.num_ghosts - 1, -1, -1) if s not in used]
