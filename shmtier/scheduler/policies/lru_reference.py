"""The LRU policy's recency ranks, evictable set and lazy min-heap in pure Python: the
reference that the C core (``shmtier.scheduler.policies._lru.LRUCore``, ``_lru.c``) is
tested against.

Who calls: tests/test_c_reference.py (the same operation sequences on both, results,
errors, table bytes, heap size and object reference counts compared) and
bench/c_vs_reference.py; lru.py uses the C core. Like the C, nothing here blocks or does I/O.

Contract (``_lru.c``'s, to the call): ranks are ``(major, minor)`` pairs, minors below
``MIN_MINOR`` compared as ``MIN_MINOR``, equal ranks ordered by key bytes; the table's
``rank_major``/``rank_minor`` and the rank counter ``counters[next_rank_index]`` (writable
int64 buffers) are written through. Per row the core keeps the rank, the resident key (a
reference to the caller's object) and whether the row is evictable. The heap is lazy: an
entry (rank, row, key) is current iff the row still holds that very key object, at that
rank, and is evictable; stale entries are dropped when popped, and the heap is rebuilt
from the rows once it holds twice the evictable rows (and at least ``MIN_REBUILD``
entries), or when one call re-ranks at least ``MIN_REBUILD`` evictable rows and a quarter
of them. The heap operations
are the C's own (top-down sift, the same child on ties), so even entries that compare
equal pop in the same order and ``heap_size`` matches the C's after every call. Errors are
the same types with the same messages at the same point of a call, so a refused call has
changed the same state (``insert_pending``, ``update_recency``, ``raise_to_request`` and
``rebuild`` stop at the bad item, the re-ranked or adopted rows pushed or heaped all the
same; ``mark_evictable`` and ``mark_non_evictable`` check all keys first). Python code can
run inside a call (the callbacks; a key's ``__hash__`` or ``__eq__`` in the rows dict or
``protected``): every method works on its argument lists as they were at the call, and a
call into the core from that code is refused (RuntimeError). Until close() the core pins
the table's memory. ``protected`` is a set or frozenset (the C raises SystemError for
others).
"""

from __future__ import annotations

from shmtier.scheduler.capi_reference import (
    all_views,
    as_long_long,
    as_ssize,
    dict_arg,
    get_buffer,
    guarded,
    release,
    ssize_arg,
    tp_name,
)

MIN_REBUILD = 64
MIN_MINOR = 1 - (1 << 48)
_INT64_MIN = -(1 << 63)
_INT64_FORMATS = ("q", "l", "<q", "=q")
_ABSENT = object()
_REENTERED = ("LRU core called from inside one of its own calls (a callback, or a key's "
              "__hash__ or __eq__)")


def _int64_view(obj, what: str) -> memoryview:
    view = get_buffer(obj, writable=True)
    try:
        if view.itemsize != 8 or view.format not in _INT64_FORMATS:
            raise TypeError(f"{what} must be a writable int64 buffer (format 'q'), "
                            f"not '{view.format}'")
        return view.cast("B").cast("q")
    finally:
        view.release()


def _check_key(key) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"offload keys are bytes, not {tp_name(key)[:100]}")


def _position(positions, key) -> int | None:
    """The position of ``key`` from a dict (read as PyDict_GetItem does) or a callable."""
    value = dict.get(positions, key) if isinstance(positions, dict) else positions(key)
    if value is None:
        return None
    position = as_long_long(value)
    if position == _INT64_MIN:
        raise OverflowError(f"position {position} of a key has no int64 rank minor (-position)")
    return position


# --- the heap: the C's sift loops, over entries ((major, minor, key), row) ---

def _sift_down(heap: list, length: int, i: int) -> None:
    item = heap[i]
    rank = item[0]
    while True:
        child = 2 * i + 1
        if child >= length:
            break
        if child + 1 < length and heap[child + 1][0] < heap[child][0]:
            child += 1
        if not heap[child][0] < rank:
            break
        heap[i] = heap[child]
        i = child
    heap[i] = item


def _sift_up(heap: list, i: int) -> None:
    item = heap[i]
    rank = item[0]
    while i > 0:
        parent = (i - 1) >> 1
        if not rank < heap[parent][0]:
            break
        heap[i] = heap[parent]
        i = parent
    heap[i] = item


def _push(heap: list, entry: tuple) -> None:
    heap.append(entry)
    _sift_up(heap, len(heap) - 1)


def _pop(heap: list) -> tuple:
    last = heap.pop()
    if not heap:
        return last
    top = heap[0]
    heap[0] = last
    _sift_down(heap, len(heap), 0)
    return top


class LRUCore:
    """``LRUCore(rows, rank_major, rank_minor, counters, next_rank_index)``: ranks,
    evictable rows and the lazy min-heap of the LRU policy (module docstring)."""

    __slots__ = ("_rows", "_get", "_tmajor", "_tminor", "_counters", "_index", "_n", "_open",
                 "_major", "_minor", "_key", "_evictable", "_num_evictable", "_heap", "_busy")

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._rows = self._key = None
        self._open = self._busy = False
        self._n = self._num_evictable = 0
        self._heap = []
        return self

    def __init__(self, rows, rank_major, rank_minor, counters, next_rank_index):
        dict_arg(rows, 1)
        index = ssize_arg(next_rank_index)
        if self._open or self._key is not None:
            raise RuntimeError("LRUCore is already initialised")
        views = all_views(_int64_view(obj, what) for obj, what in (
            (rank_major, "rank_major"), (rank_minor, "rank_minor"), (counters, "counters")))
        tmajor, tminor, tcounters = views
        n = len(tmajor)
        if len(tminor) != n or index < 0 or index >= len(tcounters):
            message = (f"rank_major has {n} rows, rank_minor {len(tminor)}; next_rank_index "
                       f"{index} of {len(tcounters)} counters")
            release(views)
            raise ValueError(message)
        self._tmajor, self._tminor, self._counters = views
        self._open = True
        self._n = n
        self._index = index
        self._major = [0] * n
        self._minor = [0] * n
        self._key = [None] * n
        self._evictable = bytearray(n)
        self._rows = rows
        self._get = dict.get.__get__(rows)  # the dict's own lookup, as PyDict_GetItem

    # --- state ---

    @property
    def num_evictable(self) -> int:
        """Evictable rows."""
        return self._num_evictable

    @property
    def heap_size(self) -> int:
        """Heap entries, stale ones included."""
        return len(self._heap)

    def _ready(self) -> None:
        if not self._open:
            raise ValueError("LRU core is closed")

    def _row_of(self, key) -> int:
        """The row of ``key`` in the rows dict, -1 if absent."""
        value = self._get(key, _ABSENT)
        if value is _ABSENT:
            return -1
        row = as_ssize(value)
        if row < 0 or row >= self._n:
            raise ValueError(f"row {row} of a key is outside the table's {self._n} rows")
        return row

    def _check_row(self, row: int) -> None:
        if row < 0 or row >= self._n:
            raise IndexError(f"row {row} is outside the table's {self._n} rows")

    def _set_rank(self, row: int, key, major: int, minor: int) -> None:
        self._tmajor[row] = major
        self._tminor[row] = minor
        self._major[row] = major
        self._minor[row] = minor if minor > MIN_MINOR else MIN_MINOR
        if self._key[row] is not key:
            self._key[row] = key

    def _next_rank(self) -> int:
        rank = self._counters[self._index] + 1
        self._counters[self._index] = rank
        return rank

    def _clear_evictable(self, row: int) -> None:
        if self._evictable[row]:
            self._evictable[row] = 0
            self._num_evictable -= 1

    def _entry(self, row: int) -> tuple:
        return (self._major[row], self._minor[row], self._key[row]), row

    def _current(self, entry: tuple) -> bool:
        (major, minor, key), row = entry
        return (self._evictable[row] and self._key[row] is key and self._major[row] == major
                and self._minor[row] == minor)

    def _rebuild_heap(self) -> None:
        evictable, entry = self._evictable, self._entry
        heap = self._heap = [entry(row) for row in range(self._n) if evictable[row]]
        length = len(heap)
        for i in range(length // 2 - 1, -1, -1):
            _sift_down(heap, length, i)

    def _maybe_compact(self) -> None:
        size = len(self._heap)
        if size >= MIN_REBUILD and size >= 2 * self._num_evictable:
            self._rebuild_heap()

    def _update_heap(self, updated: list[int]) -> None:
        """The evictable rows ``updated`` were re-ranked: push them, or rebuild when that
        many pushes would cost more than a linear heapify."""
        if not updated:
            return
        if len(updated) >= max(self._num_evictable // 4, MIN_REBUILD):
            self._rebuild_heap()
            return
        heap, entry = self._heap, self._entry
        for row in updated:
            _push(heap, entry(row))
        self._maybe_compact()

    def _forget(self) -> None:
        self._heap = []
        self._key = [None] * self._n
        self._evictable = bytearray(self._n)
        self._num_evictable = 0

    # --- methods ---

    @guarded(_REENTERED)
    def insert_pending(self, keys, rows, positions, request_rank) -> None:
        """Rank each newly inserted (key, row) of two equal-length lists, pending (not
        evictable): a key with a position ranks (request rank, -position), the request rank
        from calling ``request_rank()`` once, on the first such key; a key without one gets
        the next rank. ``positions``: a dict key -> position or a callable(key) -> position
        or None."""
        self._ready()
        if not isinstance(keys, list) or not isinstance(rows, list) or len(keys) != len(rows):
            raise TypeError("insert_pending takes two lists of equal length")
        rank = None
        for key, row_obj in zip(tuple(keys), tuple(rows)):  # the callbacks cannot change them
            row = as_ssize(row_obj)
            _check_key(key)
            self._check_row(row)
            position = _position(positions, key)
            self._clear_evictable(row)
            if position is None:
                self._set_rank(row, key, self._next_rank(), 0)
                continue
            if rank is None:
                rank = as_long_long(request_rank())
            self._set_rank(row, key, rank, -position)

    @guarded(_REENTERED)
    def update_recency(self, keys, reverse) -> None:
        """Fresh ranks in the order of the list ``keys`` (from its end if ``reverse``): the
        last key ranked becomes the most recent. Keys that are not resident are skipped."""
        if not isinstance(keys, list):
            raise TypeError("update_recency(keys: list, reverse: bool)")
        self._ready()
        keys = tuple(keys)  # as they are now, whatever a lookup runs
        order = reversed(keys) if reverse else keys
        key_of, evictable, updated = self._key, self._evictable, []
        try:
            for key in order:
                row = self._row_of(key)
                if row < 0 or key_of[row] is None:
                    continue
                self._set_rank(row, key_of[row], self._next_rank(), 0)
                if evictable[row]:
                    updated.append(row)
        finally:  # the rows re-ranked before a bad key too: their old entries are stale
            self._update_heap(updated)

    @guarded(_REENTERED)
    def raise_to_request(self, keys, positions, request_rank) -> None:
        """Raise each resident key of the list with a known position to (request_rank,
        -position) if that is newer than its rank (``positions`` as for insert_pending)."""
        if not isinstance(keys, list):
            raise TypeError("raise_to_request(keys: list, positions, request_rank: int)")
        self._ready()
        request_rank = as_long_long(request_rank)
        key_of, evictable, updated = self._key, self._evictable, []
        try:
            for key in tuple(keys):  # as they are now, whatever a callback runs
                row = self._row_of(key)
                if row < 0 or key_of[row] is None:
                    continue  # about to be stored: insert ranks it
                position = _position(positions, key)
                if position is None:
                    continue
                minor = max(-position, MIN_MINOR)
                major = self._major[row]
                if major > request_rank or (major == request_rank and self._minor[row] >= minor):
                    continue
                self._set_rank(row, key_of[row], request_rank, -position)
                if evictable[row]:
                    updated.append(row)
        finally:  # the rows re-ranked before a bad key too
            self._update_heap(updated)

    @guarded(_REENTERED)
    def evict(self, n, protected) -> list[tuple[bytes, int]] | None:
        """Take exactly ``n`` evictable keys not in the set ``protected``, oldest rank
        first, and forget them; or take none and return None."""
        self._ready()
        n = as_ssize(n)
        if n <= 0:
            return []
        if n > self._num_evictable:
            return None
        heap, current = self._heap, self._current
        selected, deferred, taken = [], [], set()
        while heap and len(selected) < n:
            entry = _pop(heap)
            row = entry[1]
            if not current(entry) or row in taken:
                continue  # stale (pinned or re-ranked since), or a twin
            try:
                is_protected = entry[0][2] in protected
            except BaseException:  # a key's __eq__ raised: all popped so far go back
                _push(heap, entry)
                for entry in deferred + selected:
                    _push(heap, entry)
                raise
            if is_protected:
                deferred.append(entry)
                continue
            taken.add(row)
            selected.append(entry)
        for entry in deferred:
            _push(heap, entry)
        if len(selected) < n:
            for entry in selected:
                _push(heap, entry)
            return None
        victims = []
        for (_, _, key), row in selected:
            victims.append((key, row))
            self._evictable[row] = 0
            self._num_evictable -= 1
            self._key[row] = None
        self._maybe_compact()
        return victims

    def _rows_of_keys(self, keys, missing_is_error: bool) -> list[int]:
        if not isinstance(keys, list):
            raise TypeError("keys must be a list")
        key_of, rows = self._key, []
        for key in tuple(keys):
            row = self._row_of(key)
            if row < 0 or key_of[row] is None:
                if not missing_is_error:
                    continue
                raise KeyError(*key) if isinstance(key, tuple) else KeyError(key)
            rows.append(row)
        return rows

    @guarded(_REENTERED)
    def mark_evictable(self, keys) -> None:
        """The resident keys of the list became evictable (KeyError for one that is not
        resident; then none is marked)."""
        self._ready()
        evictable, heap, entry = self._evictable, self._heap, self._entry
        for row in self._rows_of_keys(keys, True):
            if not evictable[row]:
                evictable[row] = 1
                self._num_evictable += 1
            _push(heap, entry(row))
        self._maybe_compact()

    @guarded(_REENTERED)
    def mark_non_evictable(self, keys) -> None:
        """The keys of the list are no longer evictable (pinned)."""
        self._ready()
        for row in self._rows_of_keys(keys, False):
            self._clear_evictable(row)

    @guarded(_REENTERED)
    def remove(self, key) -> None:
        """Forget ``key`` (its store failed); no-op if unknown."""
        self._ready()
        row = self._row_of(key)
        if row >= 0 and self._key[row] is not None:
            self._clear_evictable(row)
            self._key[row] = None

    @guarded(_REENTERED)
    def rebuild(self, refcnt) -> None:
        """Forget everything, then adopt every key of the rows dict at the table's rank;
        evictable where the int32 buffer ``refcnt`` holds 0 (warm restart)."""
        self._ready()
        view = get_buffer(refcnt, writable=False)
        try:
            if view.itemsize != 4 or view.nbytes // 4 != self._n:
                raise ValueError(f"refcnt must be int32 over {self._n} rows")
            counts = view.cast("B").cast("i")
            self._forget()
            try:
                tmajor, tminor, evictable = self._tmajor, self._tminor, self._evictable
                for key, value in self._rows.items():
                    row = as_ssize(value)
                    self._check_row(row)
                    _check_key(key)
                    self._set_rank(row, key, tmajor[row], tminor[row])
                    if counts[row] == 0 and not evictable[row]:  # a row two keys claim: once
                        evictable[row] = 1
                        self._num_evictable += 1
            finally:
                counts.release()
                self._rebuild_heap()  # also after a bad entry: the rows adopted before it
        finally:
            view.release()

    @guarded(_REENTERED)
    def clear(self) -> None:
        """Forget every key (reset); the caller resets the rank counter."""
        self._ready()
        self._forget()

    @guarded(_REENTERED)
    def close(self) -> None:
        """Forget every key and release the table's buffers (idempotent); later calls
        raise ValueError."""
        if self._key is not None:
            self._forget()
        if self._open:
            release((self._tmajor, self._tminor, self._counters))
            self._open = False
        self._tmajor = self._tminor = self._counters = None

    def rank(self, row) -> tuple[int, int] | None:
        """The row's rank (minor clamped), or None."""
        row = as_ssize(row)
        self._check_row(row)
        if self._key is None or self._key[row] is None:
            return None
        return self._major[row], self._minor[row]
