"""The CPU tier's per-key row bookkeeping in pure Python: the reference that the C version
(``shmtier.scheduler._rows``, ``_rows.c``) is tested against.

Who calls: tests/test_c_reference.py (the same operation sequences on both, results, errors,
table bytes and object reference counts compared) and bench/c_vs_reference.py; nothing in
the scheduler imports it. Like the C, nothing here blocks or does I/O.

Contract (``_rows.c``'s, to the call): :class:`RowIndex` keeps nothing of its own; it works
on the primary's ``key -> row`` dict (shared, not copied) and on the chunk table's arrays
(``keys``, ``key_len``, ``refcnt``, ``tiers``: any C-contiguous writable buffers of 1-, 1-,
4- and 8-byte items; their meaning is chunk_table.py's module docstring). A row is
resident-and-readable at ref count >= 0, store-pending at -1. Results are the same objects
in the same order as the C's (the dict's row objects in ``pin``'s rows, the caller's key
objects in every key list); errors are the same types with the same messages, raised at
the same point, so what a refused call changed before refusing is the same too (``claim``,
``pin`` and ``unpin`` check everything first and change nothing; ``release`` and
``mark_stored`` stop at the bad item). Python code can run inside a call (a dict key's
``__hash__`` or ``__eq__``): every method works on its argument lists as they were at the
call, and a call into the index from that code is refused (RuntimeError). Until close()
the index pins the table's memory (the C holds an export of each buffer given; this
reference, views sharing their exporter). Not promised: ``groups`` values that are not
lists (the C raises SystemError).
"""

from __future__ import annotations

from shmtier.scheduler.capi_reference import (
    all_views,
    as_ssize,
    dict_arg,
    get_buffer,
    guarded,
    key_hex,
    keys_snapshot,
    release,
    ssize_arg,
    tp_name,
)

_ABSENT = object()
_REENTERED = "row index called from inside one of its own calls (a key's __hash__ or __eq__)"


def _table_view(obj, itemsize: int, fmt: str, what: str) -> memoryview:
    view = get_buffer(obj, writable=True)
    if view.itemsize != itemsize:
        got = view.itemsize
        view.release()
        raise TypeError(f"{what} must be a writable buffer of {itemsize}-byte items, not {got}")
    try:
        return view.cast("B").cast(fmt) if fmt != "B" else view.cast("B")
    finally:
        view.release()


class RowIndex:
    """``RowIndex(rows, keys, key_len, refcnt, tiers, key_width)``: the CPU tier's per-key
    row operations over its rows dict and chunk table (module docstring)."""

    __slots__ = ("_rows", "_get", "_keys", "_key_len", "_refcnt", "_tiers", "_n",
                 "_key_width", "_open", "_busy")

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._rows = None
        self._open = self._busy = False
        self._n = self._key_width = 0
        return self

    def __init__(self, rows, keys, key_len, refcnt, tiers, key_width):
        dict_arg(rows, 1)
        key_width = ssize_arg(key_width)
        if self._open or self._rows is not None:
            raise RuntimeError("RowIndex is already initialised")
        views = all_views(_table_view(obj, itemsize, fmt, what) for obj, itemsize, fmt, what in (
            (keys, 1, "B", "keys"), (key_len, 1, "B", "key_len"), (refcnt, 4, "i", "refcnt"),
            (tiers, 8, "Q", "tiers")))
        keys_view, key_len_view, refcnt_view, tiers_view = views
        n = len(key_len_view)
        if (key_width < 1 or key_width > 255 or len(keys_view) != n * key_width
                or refcnt_view.nbytes != 4 * n or tiers_view.nbytes != 8 * n):
            message = (f"table arrays disagree: {n} rows of key_len, {len(keys_view)} key bytes "
                       f"for key width {key_width}, {refcnt_view.nbytes} refcnt bytes, "
                       f"{tiers_view.nbytes} tiers bytes")
            release(views)
            raise ValueError(message)
        self._keys, self._key_len, self._refcnt, self._tiers = views
        self._open = True
        self._n = n
        self._key_width = key_width
        self._rows = rows
        self._get = dict.get.__get__(rows)  # the dict's own lookup, as PyDict_GetItem

    def _ready(self) -> None:
        if not self._open:
            raise ValueError("row index is closed")

    def _row_value(self, value) -> int:
        row = as_ssize(value)
        if row < 0 or row >= self._n:
            raise ValueError(f"row {row} of a key is outside the table's {self._n} rows")
        return row

    def _row_of(self, key) -> int:
        """The row of ``key``, -1 if absent."""
        value = self._get(key, _ABSENT)
        return -1 if value is _ABSENT else self._row_value(value)

    def _table_row(self, value) -> int:
        row = as_ssize(value)
        if row < 0 or row >= self._n:
            raise IndexError(f"row {row} is outside the table's {self._n} rows")
        return row

    @guarded(_REENTERED)
    def classify(self, keys) -> tuple[list, list]:
        """(absent, ready): the keys not resident, and those resident and readable, in
        order; keys whose store is pending are in neither."""
        self._ready()
        refcnt, row_of = self._refcnt, self._row_of
        absent, ready = [], []
        for key in keys_snapshot(keys):
            row = row_of(key)
            if row < 0:
                absent.append(key)
            elif refcnt[row] >= 0:
                ready.append(key)
        return absent, ready

    @guarded(_REENTERED)
    def ready_keys(self, keys) -> list:
        """The resident, readable keys (ref count >= 0), in order."""
        self._ready()
        refcnt, row_of = self._refcnt, self._row_of
        return [key for key in keys_snapshot(keys)
                if (row := row_of(key)) >= 0 and refcnt[row] >= 0]

    @guarded(_REENTERED)
    def claim(self, keys, rows) -> None:
        """Give each key of the list its row of the list: write the key into the table, its
        ref count -1 (store pending), and map it in the rows dict. Everything is checked
        before anything is written."""
        if not isinstance(keys, list) or not isinstance(rows, list) or len(keys) != len(rows):
            raise TypeError("claim(keys, rows) takes two lists of equal length")
        self._ready()
        width = self._key_width
        keys, rows = tuple(keys), tuple(rows)  # as they are now, whatever a lookup runs
        for key, row_obj in zip(keys, rows):
            if not isinstance(key, bytes):
                raise TypeError(f"offload keys are bytes, not {tp_name(key)[:100]}")
            if len(key) > width:
                raise ValueError(f"offload key of {len(key)} bytes does not fit the key width "
                                 f"of {width}")
            self._table_row(row_obj)
        table_keys, key_len, refcnt, dict_rows = self._keys, self._key_len, self._refcnt, self._rows
        for key, row_obj in zip(keys, rows):
            row = as_ssize(row_obj)
            start = row * width
            table_keys[start:start + len(key)] = key
            key_len[row] = len(key)
            refcnt[row] = -1
            dict_rows[key] = row_obj

    @guarded(_REENTERED)
    def release(self, victims, free_list) -> None:
        """Forget each (key, row) of the list: unmap the key, clear the row's key length and
        tier bits, append the row to ``free_list``. Stops at the first bad pair."""
        if not isinstance(victims, list) or not isinstance(free_list, list):
            raise TypeError("release(victims: list, free_list: list)")
        self._ready()
        dict_rows, key_len, tiers = self._rows, self._key_len, self._tiers
        for pair in tuple(victims):
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise TypeError("victims are (key, row) pairs")
            key, row_obj = pair
            row = self._table_row(row_obj)
            del dict_rows[key]
            key_len[row] = 0
            tiers[row] = 0
            free_list.append(row_obj)

    @guarded(_REENTERED)
    def pin(self, keys) -> tuple[list, list]:
        """(rows, newly_pinned): add a reader to every key, all resident and readable (else
        KeyError naming the first that is not, and nothing changes); the rows in key order
        (the dict's objects) and the keys whose ref count left 0."""
        self._ready()
        seq = keys_snapshot(keys)
        refcnt, get = self._refcnt, self._get
        ids = []
        for key in seq:
            value = get(key, _ABSENT)
            if value is _ABSENT:
                raise KeyError(f"cannot load key {key_hex(key)}: it is not in the CPU tier")
            row = self._row_value(value)
            if refcnt[row] < 0:
                raise KeyError(f"cannot load key {key_hex(key)}: its store has not completed")
            ids.append(value)
        pinned = []
        for key, value in zip(seq, ids):
            row = int(value)
            count = refcnt[row]
            refcnt[row] = count + 1
            if count == 0:
                pinned.append(key)
        return ids, pinned

    @guarded(_REENTERED)
    def unpin(self, keys) -> list:
        """Drop a reader from every key, each holding a pin per listing (else KeyError naming
        the first that does not, and nothing changes); the keys whose ref count went to 0."""
        self._ready()
        seq = keys_snapshot(keys)
        refcnt = self._refcnt
        rows = []
        for key in seq:
            row = self._row_of(key)
            if row < 0 or refcnt[row] <= 0:
                raise KeyError(f"complete_load for key {key_hex(key)} that is not pinned")
            rows.append(row)
        times: dict[int, int] = {}
        for row in rows:
            times[row] = times.get(row, 0) + 1
        for key, row in zip(seq, rows):
            if times[row] > refcnt[row]:
                raise KeyError(f"complete_load lists key {key_hex(key)} {times[row]} times; "
                               f"it holds {refcnt[row]} pins")
        unpinned = []
        for key, row in zip(seq, rows):
            count = refcnt[row] - 1
            refcnt[row] = count
            if count == 0:
                unpinned.append(key)
        return unpinned

    @guarded(_REENTERED)
    def mark_stored(self, keys) -> list:
        """The keys whose store was pending (ref count -1) become ready (0); returns them in
        order. Absent and ready keys are ignored; stops at a key whose row is bad."""
        self._ready()
        refcnt, row_of = self._refcnt, self._row_of
        done = []
        for key in keys_snapshot(keys):
            row = row_of(key)
            if row >= 0 and refcnt[row] < 0:
                refcnt[row] = 0
                done.append(key)
        return done

    def close(self) -> None:
        """Release the table's buffers (idempotent); later calls raise ValueError."""
        if self._busy:
            raise RuntimeError("row index closed from inside one of its own calls (a key's "
                               "__hash__ or __eq__)")
        if self._open:
            release((self._keys, self._key_len, self._refcnt, self._tiers))
            self._open = False
        self._keys = self._key_len = self._refcnt = self._tiers = None


def first_accesses(keys, seen, groups, suffix_len) -> list:
    """The keys of the iterable not in the set ``seen``, once each, in order; each is added
    to ``seen`` and appended to ``groups[g]`` (a dict of lists), g the key's last
    ``suffix_len`` (1..8) bytes read big-endian (the contract's get_offload_group_idx)."""
    if not isinstance(seen, set) or not isinstance(groups, dict):
        raise TypeError("first_accesses(keys, seen: set, groups: dict, suffix_len: int)")
    suffix_len = as_ssize(suffix_len)
    if suffix_len < 1 or suffix_len > 8:
        raise ValueError(f"suffix_len must be 1..8, not {suffix_len}")
    contains, add, get = set.__contains__.__get__(seen), set.add.__get__(seen), dict.get.__get__(groups)
    new_keys = []
    for key in keys:
        if contains(key):
            continue
        if not isinstance(key, bytes) or len(key) < suffix_len:
            raise TypeError(f"offload keys are bytes of at least {suffix_len}, not {key!r}")
        index = int.from_bytes(key[len(key) - suffix_len:], "big")
        group = get(index)
        if group is None:
            group = []
            dict.__setitem__(groups, index, group)
        add(key)
        group.append(key)
        new_keys.append(key)
    return new_keys
