"""The scheduler's C helpers against their pure-Python references (issue 30): ``_rows.RowIndex``
and ``first_accesses`` (shmtier/scheduler/rows_reference.py), ``_lru.LRUCore``
(shmtier/scheduler/policies/lru_reference.py).

Hypothesis state machines drive a C side and a reference side with the same operations,
each side on its own chunk table, rows dict and key objects (equal bytes, distinct
objects), and compare after every step: results (which of the side's own objects came
back, in which order), errors (type and message), the table bytes, the LRU heap size and
every rank, and the reference count of every key and row object. The references hold
exactly one reference where the C holds one, so a leaked or over-released reference in
the C shows as a count that differs. Operations include what the primary never sends
(bad rows, unhashable and non-bytes keys, rows dict values out of range, duplicated rows
before a warm restart, failing callbacks) so the error paths are compared too, and Python
code run inside a call (a rows-dict key's ``__eq__``, the LRU callbacks) that empties the
argument list, calls the index or core again, or closes it.

The tests at the end pin the bugs these found in the C (fixed there).

scripts/test-sanitizers runs this file again against the extensions built with
AddressSanitizer and UndefinedBehaviorSanitizer.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shmtier.scheduler import _rows, rows_reference
from shmtier.scheduler.policies import _lru, lru_reference
from shmtier.shared.chunk_table import NEXT_RANK, ChunkTable

# each machine stays within a few seconds (this file's budget in the suite: 20 s); no
# explain phase: its line tracing takes minutes over a failing state machine
MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                            suppress_health_check=[HealthCheck.too_slow])


def _fresh(value):
    """A new object equal to ``value`` (CPython still shares empty and one-byte bytes,
    small ints and one-character strings)."""
    if isinstance(value, bytes):
        return bytes(bytearray(value))
    if isinstance(value, bytearray):
        return bytearray(value)
    if isinstance(value, int):
        return int(str(value))
    if isinstance(value, str):
        return "".join(list(value))
    return value


HOSTILE, PROBE = "<hostile>", "<probe>"  # pool markers: objects made per side
HOSTILE_ACTIONS = st.sampled_from(["none", "none", "clear the argument", "call again", "close"])


class Hostile:
    """A dict key whose ``__eq__`` runs the side's hostile action while a call is under way:
    clear the list the call was given, call the index or core again, or close it. It hashes
    like the pool's first key, so lookups of that key (and of the probe) compare with it."""

    def __init__(self, side: "Side", hash_value: int):
        self.side, self.hash_value = side, hash_value

    def __hash__(self):
        return self.hash_value

    def __eq__(self, other):
        self.side.act()
        return False

    def __repr__(self):
        return "Hostile()"


class Probe:
    """Never in a dict: looking it up compares it with every key of its hash (the hostile)."""

    def __init__(self, hash_value: int):
        self.hash_value = hash_value

    def __hash__(self):
        return self.hash_value

    def __eq__(self, other):
        return False

    def __repr__(self):
        return "Probe()"


class Side:
    """One side of a differential test: an implementation (the C module or its reference),
    its own table, rows dict and copies of the key pool and of the row numbers."""

    def __init__(self, impl, pool: list, num_rows: int, key_width: int):
        self.impl = impl
        collide = hash(pool[0])
        self.keys = [Hostile(self, collide) if v == HOSTILE else Probe(collide) if v == PROBE
                     else _fresh(v) for v in pool]
        self.row_objs = [_fresh(r) for r in range(num_rows)]
        self.num_rows = num_rows
        self.table = ChunkTable.private(num_rows, key_width)
        self.rows: dict = {}
        self.in_call = False
        self.action: str | None = None
        self.last_list: list = []

    def reenter(self) -> None:
        raise NotImplementedError

    def close_target(self) -> None:
        raise NotImplementedError

    def act(self) -> None:
        """The hostile action, inside a call only (``both`` marks it)."""
        if not self.in_call or self.action is None:
            return
        if self.action == "clear the argument":
            self.last_list.clear()
        elif self.action == "call again":
            self.reenter()
        elif self.action == "close":
            self.close_target()

    def key_list(self, indexes) -> list:
        self.last_list = [self.keys[i] for i in indexes]
        return self.last_list

    def sequence(self, indexes, container: str):
        keys = self.key_list(indexes)
        return {"list": keys, "tuple": tuple(keys), "iter": iter(list(keys))}.get(container, 5)

    def plain_keys(self) -> list[int]:
        """The pool's indexes of keys that run no code of the test's."""
        return [i for i, k in enumerate(self.keys) if type(k) not in (Hostile, Probe)]

    def canon(self, obj):
        """``obj`` with this side's own objects named: ("key", i) for key object i of the
        pool, ("int", value, is this side's row object) for ints."""
        if type(obj) in (list, tuple):
            return type(obj).__name__, [self.canon(item) for item in obj]
        for i, key in enumerate(self.keys):
            if obj is key:
                return "key", i
        if type(obj) is int:
            own = 0 <= obj < self.num_rows and obj is self.row_objs[obj]
            return "int", obj, own
        return type(obj).__name__, repr(obj)

    def canon_dict(self, d: dict) -> list:
        return [(self.canon(k), self.canon(v)) for k, v in d.items()]


def both(c: Side, py: Side, call):
    """``call(side)`` on each side; asserts equal results or equal errors; returns the C's."""
    outcomes = []
    for side in (c, py):
        side.in_call = True
        try:
            value = call(side)
        except Exception as exc:  # noqa: BLE001 - every error is compared
            outcomes.append(("raised", type(exc).__name__, str(exc)))
        else:
            outcomes.append(("ok", side.canon(value)))
            del value
        finally:
            side.in_call = False
    assert outcomes[0] == outcomes[1], f"C: {outcomes[0]}\nreference: {outcomes[1]}"
    return outcomes[0]


def assert_same_refcounts(c: Side, py: Side) -> None:
    for i, (kc, kp) in enumerate(zip(c.keys, py.keys)):
        if kc is not kp:  # objects CPython shares between the sides count both sides' holders
            assert sys.getrefcount(kc) == sys.getrefcount(kp), f"references to key {i} ({kc!r})"
    for r, (rc, rp) in enumerate(zip(c.row_objs, py.row_objs)):
        if rc is not rp:
            assert sys.getrefcount(rc) == sys.getrefcount(rp), f"references to row object {r}"


def assert_same_bytes(c: Side, py: Side, arrays: tuple[str, ...]) -> None:
    for name in arrays:
        assert bytes(getattr(c.table, name)) == bytes(getattr(py.table, name)), name


class DifferentialMachine(RuleBasedStateMachine):
    """What both machines share: a C side and a reference side, and the rules that map the
    poison key to a bad row value (or a row another key has), put the hostile key in the
    rows dict, set the hostile action, and now and then close both."""

    side_type: type
    c_impl = reference_impl = None
    poison_key = hostile_key_index = 0
    rows_in_play: list[int] = []

    def __init__(self):
        super().__init__()
        self.c = self.side_type(self.c_impl)
        self.py = self.side_type(self.reference_impl)

    def both(self, call):
        return both(self.c, self.py, call)

    def map_key(self, key: int, row) -> None:
        """``rows[key] = row`` on both sides (a row of the table as the side's row object),
        or the key unmapped for None."""
        for side in (self.c, self.py):
            if row is None:
                side.rows.pop(side.keys[key], None)
            else:
                in_table = type(row) is int and 0 <= row < side.num_rows
                side.rows[side.keys[key]] = side.row_objs[row] if in_table else row

    @rule(data=st.data())
    def poison(self, data):
        bad = [self.c.num_rows, -1, "x", 2**70, *self.rows_in_play[:2]]
        self.map_key(self.poison_key, data.draw(st.sampled_from(bad)))

    @rule()
    def unpoison(self):
        self.map_key(self.poison_key, None)

    @rule(data=st.data(), present=st.booleans())
    def hostile_key(self, data, present):
        """A key in the rows dict whose __eq__ runs the hostile action (see Hostile)."""
        self.map_key(self.hostile_key_index,
                     data.draw(st.sampled_from(self.rows_in_play)) if present else None)

    @rule(action=HOSTILE_ACTIONS)
    def hostile_action(self, action):
        """What the hostile key and the callbacks do inside a call (see Hostile)."""
        self.c.action = self.py.action = None if action == "none" else action

    @rule(coin=st.integers(0, 39))
    def close(self, coin):
        if coin == 0:
            self.both(lambda side: side.close_target())

    def teardown(self):
        self.c.close_target()
        self.py.close_target()


# --- RowIndex and first_accesses ---

KEY_WIDTH = 8
ROW_POOL = [
    *(bytes([i, i]) + bytes([i + 1]) * (i % 7) for i in range(10)),  # 2..8 bytes
    b"\xff" * 8,                 # exactly the key width
    b"\xfe" * 9,                 # one byte too long for claim
    b"ab", b"ab",                # equal bytes, distinct objects (a second copy of one key)
    b"", b"z",                   # objects CPython shares (no reference count check)
    7, 2**70,                    # int keys: hashable, not bytes, no .hex()
    "text",                      # a str key
    bytearray(b"cd"),            # unhashable
    b"poison",                   # mapped to bad row values by the poison rule, never claimed
    HOSTILE, PROBE,
]
LONG_KEY, STR_KEY, POISON, HOSTILE_KEY = 11, 18, 20, 21
CLAIMABLE = [i for i, v in enumerate(ROW_POOL) if type(v) is bytes and len(v) <= KEY_WIDTH
             and i != POISON]
NUM_ROWS_IX = 260  # rows from 256 up are int objects of their own: reference counts checked
ROWS_IN_USE = [0, 1, 2, 3, 256, 257, 258, 259]
CONTAINERS = st.sampled_from(["list", "list", "list", "tuple", "iter", "not iterable"])


class RowSide(Side):
    def __init__(self, impl):
        super().__init__(impl, ROW_POOL, NUM_ROWS_IX, KEY_WIDTH)
        t = self.table
        self.index = impl.RowIndex(self.rows, t.keys, t.key_len, t.refcnt, t.tiers, KEY_WIDTH)
        self.free: list = []
        self.seen: set = set()
        self.groups: dict = {}

    def resident(self) -> list[int]:
        return [i for i in self.plain_keys()
                if type(self.keys[i]) is not bytearray and self.keys[i] in self.rows]

    def reenter(self):
        self.index.classify([])

    def close_target(self):
        self.index.close()


class RowIndexMachine(DifferentialMachine):
    side_type, c_impl, reference_impl = RowSide, _rows, rows_reference
    poison_key, hostile_key_index, rows_in_play = POISON, HOSTILE_KEY, ROWS_IN_USE

    @initialize(data=st.data(), hostile=HOSTILE_ACTIONS)
    def fill(self, data, hostile):
        """Start with some keys claimed, some of them stored, maybe a hostile key."""
        keys = data.draw(st.lists(st.sampled_from(CLAIMABLE), max_size=len(ROWS_IN_USE),
                                  unique_by=lambda i: ROW_POOL[i]))
        rows = data.draw(st.permutations(ROWS_IN_USE))[:len(keys)]
        stored = data.draw(st.lists(st.sampled_from(keys), max_size=len(keys))) if keys else []

        def call(side):
            side.index.claim(side.key_list(keys), [side.row_objs[r] for r in rows])
            return side.index.mark_stored(side.key_list(stored))
        self.both(call)
        if hostile != "none":
            self.map_key(HOSTILE_KEY, ROWS_IN_USE[0])
            self.hostile_action(hostile)

    def draw_keys(self, data, least_refcnt: int = -1, max_size: int = 6) -> list[int]:
        """Often only resident keys of ref count >= ``least_refcnt`` (so that pins and
        unpins succeed), else any keys of the pool."""
        c = self.c
        fit = [i for i in c.resident() if i != POISON and c.table.refcnt[c.rows[c.keys[i]]] >= least_refcnt]
        if fit and data.draw(st.booleans()):
            return data.draw(st.lists(st.sampled_from(fit), max_size=max_size))
        return data.draw(st.lists(st.integers(0, len(ROW_POOL) - 1), max_size=max_size))

    @rule(data=st.data(),
          bad=st.sampled_from([None] * 8 + ["long", "str", "row 260", "row -1", "row 1.0",
                                            "row 2**70", "lengths", "tuple"]))
    def claim(self, data, bad):
        used = set(self.c.rows.values())
        free = [r for r in ROWS_IN_USE if r not in used]
        absent = [i for i in CLAIMABLE if self.c.keys[i] not in self.c.rows]
        count = data.draw(st.integers(0, min(len(free), len(absent), 4)))
        keys = data.draw(st.lists(st.sampled_from(absent), min_size=count, max_size=count,
                                  unique_by=lambda i: ROW_POOL[i])) if count else []
        rows = data.draw(st.permutations(free))[:count]

        def call(side):
            ks, rs = side.key_list(keys), [side.row_objs[r] for r in rows]
            extra = {"long": (side.keys[LONG_KEY], side.row_objs[0]),
                     "str": (side.keys[STR_KEY], side.row_objs[0]),
                     "row 260": (side.keys[0], 260), "row -1": (side.keys[0], -1),
                     "row 1.0": (side.keys[0], 1.0), "row 2**70": (side.keys[0], 2**70)}.get(bad)
            if extra is not None:
                ks.append(extra[0])
                rs.append(extra[1])
            if bad == "lengths":
                ks.append(side.keys[0])
            if bad == "tuple":
                return side.index.claim(tuple(ks), rs)
            return side.index.claim(ks, rs)
        self.both(call)

    @rule(data=st.data(), container=CONTAINERS)
    def classify(self, data, container):
        keys = self.draw_keys(data)
        self.both(lambda side: side.index.classify(side.sequence(keys, container)))

    @rule(data=st.data(), container=CONTAINERS)
    def ready_keys(self, data, container):
        keys = self.draw_keys(data)
        self.both(lambda side: side.index.ready_keys(side.sequence(keys, container)))

    @rule(data=st.data(), container=CONTAINERS)
    def mark_stored(self, data, container):
        keys = self.draw_keys(data)
        self.both(lambda side: side.index.mark_stored(side.sequence(keys, container)))

    @rule(data=st.data(), container=CONTAINERS)
    def pin(self, data, container):
        keys = self.draw_keys(data, least_refcnt=0)
        self.both(lambda side: side.index.pin(side.sequence(keys, container)))

    @rule(data=st.data(), container=CONTAINERS)
    def unpin(self, data, container):
        keys = self.draw_keys(data, least_refcnt=1)
        self.both(lambda side: side.index.unpin(side.sequence(keys, container)))

    @rule(data=st.data(), bad=st.sampled_from([None] * 5 + ["row 260", "list pair", "triple",
                                                              "absent", "victims tuple"]))
    def release(self, data, bad):
        resident = [i for i in self.c.resident() if i != POISON]
        victims = data.draw(st.lists(st.sampled_from(resident), max_size=3,
                                     unique_by=lambda i: ROW_POOL[i])) if resident else []

        def call(side):
            pairs = [(side.keys[i], side.rows[side.keys[i]]) for i in victims]
            extra = {"row 260": (side.keys[0], 260), "list pair": [side.keys[0], 0],
                     "triple": (side.keys[0], 0, 0), "absent": (side.keys[LONG_KEY], 0)}.get(bad)
            if extra is not None:
                pairs.insert(len(pairs) // 2, extra)
            if bad == "victims tuple":
                return side.index.release(tuple(pairs), side.free)
            return side.index.release(pairs, side.free)
        self.both(call)

    @rule(row=st.sampled_from(ROWS_IN_USE), bits=st.integers(0, 2**64 - 1))
    def set_tier_bits(self, row, bits):
        self.c.table.tiers[row] = self.py.table.tiers[row] = bits

    @rule(data=st.data(), container=CONTAINERS,
          suffix_len=st.sampled_from([4, 4, 4, 1, 2, 8, 0, 9, "x", 2**70]),
          seen=st.sampled_from(["set"] * 6 + ["frozenset", "groups tuple"]))
    def first_accesses(self, data, container, suffix_len, seen):
        keys = self.draw_keys(data)

        def call(side):
            seen_arg = frozenset(side.seen) if seen == "frozenset" else side.seen
            groups = tuple(side.groups) if seen == "groups tuple" else side.groups
            return side.impl.first_accesses(side.sequence(keys, container), seen_arg, groups,
                                            suffix_len)
        self.both(call)

    @invariant()
    def same_state(self):
        c, py = self.c, self.py
        assert_same_bytes(c, py, ("keys", "key_len", "refcnt", "tiers"))
        assert c.canon_dict(c.rows) == py.canon_dict(py.rows)
        assert c.canon(c.free) == py.canon(py.free)
        assert sorted(map(c.canon, c.seen)) == sorted(map(py.canon, py.seen))
        assert c.canon_dict(c.groups) == py.canon_dict(py.groups)
        assert_same_refcounts(c, py)


TestRowIndexAgainstReference = RowIndexMachine.TestCase
TestRowIndexAgainstReference.settings = MACHINE_SETTINGS


# --- LRUCore ---

LRU_ROWS = 72  # past MIN_REBUILD (64): one call can re-rank enough rows to rebuild the heap
LRU_POOL = [
    *(bytes([i // 8, i % 8]) + b"k" * (i % 3) for i in range(LRU_ROWS + 4)),
    b"\x00\x00k",                # an extension of key 0's bytes: orders right after it
    b"\x00\x01k", b"\x00\x02kk", # second copies of keys 1 and 2 (equal bytes, distinct objects)
    "text", 9,                   # keys insert_pending refuses
    b"poison",                   # mapped to bad row values by the poison rule, never inserted
    HOSTILE, PROBE,
]
LRU_POISON, LRU_HOSTILE = len(LRU_POOL) - 3, len(LRU_POOL) - 2
LRU_KEYS = [i for i, v in enumerate(LRU_POOL) if type(v) is bytes and i != LRU_POISON]
POSITIONS = st.one_of(st.integers(0, 40), st.sampled_from(
    [None, 2**48 - 2, 2**48 - 1, 2**48, 2**48 + 5, 2**63 - 1, -1, -(2**63), 1.5]))
REQUEST_RANKS = st.one_of(st.integers(0, 60), st.sampled_from(
    [-(2**63), 2**63 - 1, 2**63, "raise", "not an int"]))


class NoTruth:
    def __bool__(self):
        raise ZeroDivisionError("reverse has no truth value")


class LRUSide(Side):
    def __init__(self, impl):
        super().__init__(impl, LRU_POOL, LRU_ROWS, 8)
        t = self.table
        self.core = impl.LRUCore(self.rows, t.rank_major, t.rank_minor, t.counters, NEXT_RANK)
        self.positions: dict = {}
        self.rank_calls = 0

    def reenter(self):
        self.core.clear()

    def close_target(self):
        self.core.close()

    def request_rank(self, spec):
        def request_rank():
            self.act()
            self.rank_calls += 1
            if spec == "raise":
                raise LookupError("no request rank")
            return spec
        return request_rank

    def positions_arg(self, as_callable: bool):
        if not as_callable:
            return self.positions

        def position(key):
            self.act()
            return self.positions.get(key)
        return position

    def resident(self) -> list[int]:
        return [i for i in LRU_KEYS if self.keys[i] in self.rows]

    def held(self) -> list[int]:
        """The resident keys whose row the core holds a key for (an insert that failed
        part-way leaves others in the rows dict)."""
        rows = self.rows
        return [i for i in self.resident() if type(rows[self.keys[i]]) is int
                and 0 <= rows[self.keys[i]] < LRU_ROWS and self.core.rank(rows[self.keys[i]])]


class LRUCoreMachine(DifferentialMachine):
    side_type, c_impl, reference_impl = LRUSide, _lru, lru_reference
    poison_key, hostile_key_index, rows_in_play = LRU_POISON, LRU_HOSTILE, list(range(LRU_ROWS))

    @initialize(data=st.data(), evictable=st.booleans(), with_positions=st.booleans(),
                touch=st.booleans(), hostile=HOSTILE_ACTIONS)
    def fill(self, data, evictable, with_positions, touch, hostile):
        """Start from a populated core: keys stored (evictable) or pending, ranked fresh or
        by position within one request, then maybe all re-ranked at once (a heap rebuild
        when 64 or more are evictable)."""
        count = data.draw(st.one_of(st.integers(0, LRU_ROWS), st.integers(64, LRU_ROWS)))
        keys = data.draw(st.permutations(LRU_KEYS))[:count]
        rows = data.draw(st.permutations(range(LRU_ROWS)))[:count]
        positions = data.draw(st.lists(st.integers(0, 20), min_size=count, max_size=count))

        def call(side):
            ks, rs = side.key_list(keys), [side.row_objs[r] for r in rows]
            for k, r, position in zip(ks, rs, positions):
                side.rows[k] = r
                if with_positions:
                    side.positions[k] = position
            side.core.insert_pending(ks, rs, side.positions, side.request_rank(1))
            if evictable:
                side.core.mark_evictable(ks)
            if touch:
                side.core.update_recency(ks, True)
        self.both(call)
        if hostile != "none":
            self.map_key(LRU_HOSTILE, data.draw(st.integers(0, LRU_ROWS - 1)))
            self.hostile_action(hostile)

    def draw_keys(self, data, max_size: int = 8) -> list[int]:
        """Often only keys the core holds, else any keys of the pool."""
        held = self.c.held()
        if held and data.draw(st.booleans()):
            return data.draw(st.lists(st.sampled_from(held), max_size=max_size))
        return data.draw(st.lists(st.integers(0, len(LRU_POOL) - 1), max_size=max_size))

    @rule(key=st.sampled_from(LRU_KEYS), position=POSITIONS)
    def set_position(self, key, position):
        for side in (self.c, self.py):
            side.positions[side.keys[key]] = position

    @rule(data=st.data(), many=st.booleans(), request_rank=REQUEST_RANKS,
          as_callable=st.booleans(),
          bad=st.sampled_from([None] * 8 + ["str key", "row 72", "row -1", "row 1.0", "lengths",
                                            "tuple"]))
    def insert_pending(self, data, many, request_rank, as_callable, bad):
        """The primary's allocation: claim free rows for keys not resident (the rows dict
        first), then rank them pending."""
        used = set(self.c.rows.values())
        free = [r for r in range(LRU_ROWS) if r not in used]
        absent = [i for i in LRU_KEYS if self.c.keys[i] not in self.c.rows]
        most = min(len(free), len(absent), LRU_ROWS if many else 6)
        count = data.draw(st.integers(most if many else 0, most))
        keys = data.draw(st.lists(st.sampled_from(absent), min_size=count, max_size=count,
                                  unique_by=lambda i: LRU_POOL[i])) if count else []
        rows = data.draw(st.permutations(free))[:count]

        def call(side):
            ks, rs = side.key_list(keys), [side.row_objs[r] for r in rows]
            for k, r in zip(ks, rs):
                side.rows[k] = r
            extra = {"str key": ("text", 0), "row 72": (side.keys[0], 72),
                     "row -1": (side.keys[0], -1), "row 1.0": (side.keys[0], 1.0)}.get(bad)
            if extra is not None:
                ks.insert(len(ks) // 2, extra[0])
                rs.insert(len(rs) // 2, extra[1])
            if bad == "lengths":
                rs.append(0)
            return side.core.insert_pending(tuple(ks) if bad == "tuple" else ks, rs,
                                            side.positions_arg(as_callable),
                                            side.request_rank(request_rank))
        self.both(call)

    @rule(data=st.data(), as_list=st.integers(0, 9))
    def mark_evictable(self, data, as_list):
        keys = self.draw_keys(data)
        self.both(lambda side: side.core.mark_evictable(
            side.key_list(keys) if as_list else tuple(side.key_list(keys))))

    @rule()
    def mark_all_evictable(self):
        """What complete_store / complete_load tell the policy, for every key it holds."""
        keys = self.c.held()
        self.both(lambda side: side.core.mark_evictable(side.key_list(keys)))

    @rule(data=st.data(), as_list=st.integers(0, 9))
    def mark_non_evictable(self, data, as_list):
        keys = self.draw_keys(data)
        self.both(lambda side: side.core.mark_non_evictable(
            side.key_list(keys) if as_list else tuple(side.key_list(keys))))

    @rule(data=st.data(), everything=st.booleans(),
          reverse=st.sampled_from([True, False, 0, 1, "no-truth"]))
    def update_recency(self, data, everything, reverse):
        keys = self.c.resident() if everything else self.draw_keys(data)
        self.both(lambda side: side.core.update_recency(
            side.key_list(keys), NoTruth() if reverse == "no-truth" else reverse))

    @rule(data=st.data(), everything=st.booleans(), as_callable=st.booleans(),
          request_rank=st.one_of(st.integers(0, 80), st.sampled_from([2**63, "x", -(2**63)])))
    def raise_to_request(self, data, everything, as_callable, request_rank):
        keys = self.c.resident() if everything else self.draw_keys(data)
        self.both(lambda side: side.core.raise_to_request(
            side.key_list(keys), side.positions_arg(as_callable), request_rank))

    @rule(data=st.data(), frozen=st.booleans())
    def evict(self, data, frozen):
        """The primary's eviction: the victims leave the rows dict (its release)."""
        n = data.draw(st.integers(-1, self.c.core.num_evictable + 1))
        protected = self.draw_keys(data, max_size=4)

        def call(side):
            keys = set(side.key_list(protected))
            victims = side.core.evict(n, frozenset(keys) if frozen else keys)
            for key, _ in victims or ():
                del side.rows[key]
            return victims
        self.both(call)

    @rule(key=st.integers(0, len(LRU_POOL) - 1), release=st.booleans())
    def remove(self, key, release):
        """A failed store: the policy forgets the key, then the primary releases its row."""
        def call(side):
            side.core.remove(side.keys[key])
            if release and side.keys[key] in side.rows:
                del side.rows[side.keys[key]]
        self.both(call)

    @rule(data=st.data(), source=st.sampled_from(["table"] * 4 + ["bytes", "key_len"]))
    def rebuild(self, data, source):
        """A warm restart: ref counts from the table (or another buffer), ranks from it."""
        counts = data.draw(st.lists(st.sampled_from([-1, 0, 0, 1]), min_size=LRU_ROWS,
                                    max_size=LRU_ROWS))

        def call(side):
            for row, count in enumerate(counts):
                side.table.refcnt[row] = count
            buffer = {"table": side.table.refcnt, "bytes": bytes(4 * LRU_ROWS),
                      "key_len": side.table.key_len}[source]
            return side.core.rebuild(buffer)
        self.both(call)

    @rule(data=st.data())
    def share_a_row(self, data):
        """An inconsistent rows dict (two keys on one row), as a corrupt table could give
        a warm restart."""
        resident, absent = self.c.resident(), [i for i in LRU_KEYS if i not in self.c.resident()]
        if resident and absent:
            holder, other = data.draw(st.sampled_from(resident)), data.draw(st.sampled_from(absent))
            for side in (self.c, self.py):
                side.rows[side.keys[other]] = side.rows[side.keys[holder]]

    @rule(value=st.sampled_from([0, 1, 2**40, 2**62]))
    def set_rank_counter(self, value):
        self.c.table.counters[NEXT_RANK] = self.py.table.counters[NEXT_RANK] = value

    @rule(coin=st.integers(0, 9))
    def clear(self, coin):
        """The policy's reset: forget everything, the rank counter back to 0."""
        if coin:
            return

        def call(side):
            side.core.clear()
            side.table.counters[NEXT_RANK] = 0
        self.both(call)

    @rule(row=st.sampled_from([LRU_ROWS, -1, "x", 2**70, True]))
    def rank_of_a_bad_row(self, row):
        self.both(lambda side: side.core.rank(row))

    @invariant()
    def same_state(self):
        c, py = self.c, self.py
        assert_same_bytes(c, py, ("rank_major", "rank_minor", "counters"))
        assert c.core.num_evictable == py.core.num_evictable
        assert c.core.heap_size == py.core.heap_size
        assert [c.core.rank(row) for row in range(LRU_ROWS)] == [
            py.core.rank(row) for row in range(LRU_ROWS)]
        assert c.rank_calls == py.rank_calls
        assert c.canon_dict(c.rows) == py.canon_dict(py.rows)
        assert_same_refcounts(c, py)
        # the reference's own invariants (the C's, as the comparisons above tie the two):
        # the count is of evictable rows, and the heap can find every one of them
        core = py.core
        if core._open:
            assert core.num_evictable == sum(core._evictable)
            in_heap = {entry[1] for entry in core._heap if core._current(entry)}
            assert in_heap == {row for row in range(LRU_ROWS) if core._evictable[row]}


TestLRUCoreAgainstReference = LRUCoreMachine.TestCase
TestLRUCoreAgainstReference.settings = MACHINE_SETTINGS


# --- the references' shape and buffers ---

def _public(obj) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


@pytest.mark.parametrize("c, reference", [
    (_rows.RowIndex, rows_reference.RowIndex),
    (_lru.LRUCore, lru_reference.LRUCore),
])
def test_the_references_have_the_c_types_public_methods(c, reference):
    assert _public(c) == _public(reference)


def test_rows_reference_module_has_the_c_modules_names():
    assert _public(_rows) == {"RowIndex", "first_accesses"}
    assert _public(_rows) <= _public(rows_reference)


def _pins_until_closed(open_table, buffers: list[bytearray], views: list[memoryview]) -> None:
    """``open_table(views)`` pins the memory of ``buffers`` (a segment could not be unmapped)
    until its close(), and nothing after it. The C holds an export of each view (the views
    cannot be released early); the reference, views sharing their exporter's."""
    owner = open_table(views)
    for view in views:
        with contextlib.suppress(BufferError):
            view.release()
    for buffer in buffers:
        with pytest.raises(BufferError):
            buffer.extend(b"\0")
    owner.close()
    owner.close()  # idempotent
    for view in views:
        view.release()
    for buffer in buffers:
        buffer.extend(b"\0")


@pytest.mark.parametrize("impl", [_lru, lru_reference], ids=["C", "reference"])
def test_lru_core_close_releases_the_table_buffers(impl):
    buffers = [bytearray(8 * 4) for _ in range(3)]
    _pins_until_closed(lambda views: impl.LRUCore({}, *views, 0), buffers,
                       [memoryview(b).cast("q") for b in buffers])


@pytest.mark.parametrize("impl", [_rows, rows_reference], ids=["C", "reference"])
def test_row_index_close_releases_the_table_buffers(impl):
    buffers = [bytearray(32), bytearray(4), bytearray(16), bytearray(32)]
    views = [memoryview(b).cast(f) for b, f in zip(buffers, "BBiQ")]
    _pins_until_closed(lambda views: impl.RowIndex({}, *views, 8), buffers, views)


ROWS, LRU = (_rows, rows_reference, "RowIndex"), (_lru, lru_reference, "LRUCore")
CONSTRUCTOR_CASES = [
    (ROWS, "dict", lambda t: ([], t.keys, t.key_len, t.refcnt, t.tiers, 8)),
    (ROWS, "key width float", lambda t: ({}, t.keys, t.key_len, t.refcnt, t.tiers, 8.0)),
    (ROWS, "read-only bytes", lambda t: ({}, bytes(32), t.key_len, t.refcnt, t.tiers, 8)),
    (ROWS, "not a buffer", lambda t: ({}, 5, t.key_len, t.refcnt, t.tiers, 8)),
    (ROWS, "refcnt of int64", lambda t: ({}, t.keys, t.key_len, t.rank_major, t.tiers, 8)),
    (ROWS, "tiers of int32", lambda t: ({}, t.keys, t.key_len, t.refcnt, t.refcnt, 8)),
    (ROWS, "key width 7", lambda t: ({}, t.keys, t.key_len, t.refcnt, t.tiers, 7)),
    (ROWS, "key width 0", lambda t: ({}, t.keys[:0], t.key_len, t.refcnt, t.tiers, 0)),
    (ROWS, "read-only view", lambda t: ({}, t.keys.toreadonly(), t.key_len, t.refcnt, t.tiers, 8)),
    (LRU, "dict", lambda t: (5, t.rank_major, t.rank_minor, t.counters, NEXT_RANK)),
    (LRU, "index str", lambda t: ({}, t.rank_major, t.rank_minor, t.counters, "x")),
    (LRU, "index 99", lambda t: ({}, t.rank_major, t.rank_minor, t.counters, 99)),
    (LRU, "index -1", lambda t: ({}, t.rank_major, t.rank_minor, t.counters, -1)),
    (LRU, "int32 ranks", lambda t: ({}, t.refcnt, t.rank_minor, t.counters, NEXT_RANK)),
    (LRU, "bytes", lambda t: ({}, t.rank_major, bytes(32), t.counters, NEXT_RANK)),
    (LRU, "unsigned", lambda t: ({}, t.rank_major, t.rank_minor, t.tiers, NEXT_RANK)),
    (LRU, "rows disagree", lambda t: ({}, t.rank_major, t.rank_minor[:2], t.counters, NEXT_RANK)),
    (LRU, "bytearray", lambda t: ({}, bytearray(32), t.rank_minor, t.counters, NEXT_RANK)),
]


@pytest.mark.parametrize("which, name, args", CONSTRUCTOR_CASES,
                         ids=[f"{c[0][2]}: {c[1]}" for c in CONSTRUCTOR_CASES])
def test_the_constructors_refuse_alike_and_hold_nothing_after(which, name, args):
    outcomes = []
    for impl in which[:2]:
        t = ChunkTable.private(4, 8)
        try:
            getattr(impl, which[2])(*args(t)).close()
            outcomes.append("built")
        except Exception as exc:  # noqa: BLE001
            outcomes.append((type(exc).__name__, str(exc)))
        for array in ("keys", "key_len", "refcnt", "tiers", "rank_major", "rank_minor", "counters"):
            getattr(t, array).release()  # a BufferError here: a refused call kept a buffer
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("impl", [_lru, lru_reference, _rows, rows_reference],
                         ids=["LRU C", "LRU reference", "rows C", "rows reference"])
def test_a_second_init_is_refused(impl):
    t = ChunkTable.private(4, 8)
    if hasattr(impl, "LRUCore"):
        args = ({}, t.rank_major, t.rank_minor, t.counters, NEXT_RANK)
        obj, kind = impl.LRUCore(*args), "LRUCore"
    else:
        args = ({}, t.keys, t.key_len, t.refcnt, t.tiers, 8)
        obj, kind = impl.RowIndex(*args), "RowIndex"
    with pytest.raises(RuntimeError, match=f"{kind} is already initialised"):
        obj.__init__(*args)
    obj.close()


# --- bugs the differential tests found in _lru.c (fixed there; regression tests) ---

@pytest.mark.parametrize("impl", [_lru, lru_reference], ids=["C", "reference"])
def test_a_row_two_keys_claim_is_counted_evictable_once_at_rebuild(impl):
    """A warm restart over a rows dict that maps two keys to one row (a corrupt table)
    used to count that row evictable twice: num_evictable then promised a victim the heap
    did not have, and evict(num_evictable, ...) returned None."""
    t = ChunkTable.private(4, 8)
    rows = {b"k0": 0, b"k1": 1, b"also on 1": 1}
    core = impl.LRUCore(rows, t.rank_major, t.rank_minor, t.counters, NEXT_RANK)
    core.rebuild(t.refcnt)  # every ref count 0
    assert core.num_evictable == 2
    assert core.evict(2, set()) == [(b"also on 1", 1), (b"k0", 0)]  # equal ranks: by key bytes
    core.close()


@pytest.mark.parametrize("impl", [_lru, lru_reference], ids=["C", "reference"])
def test_a_position_whose_negation_overflows_is_refused(impl):
    """The rank minor is -position: for -2**63 that was a signed overflow in C (undefined
    behaviour; it wrote -2**63 as the minor). Now an OverflowError, before the key's row
    changes; the keys before it are ranked."""
    t = ChunkTable.private(4, 8)
    rows = {b"k0": 0, b"k1": 1}
    core = impl.LRUCore(rows, t.rank_major, t.rank_minor, t.counters, NEXT_RANK)
    message = "position -9223372036854775808 of a key has no int64 rank minor"
    with pytest.raises(OverflowError, match=message):
        core.insert_pending([b"k0", b"k1"], [0, 1], {b"k0": 5, b"k1": -(2**63)}, lambda: 7)
    assert (core.rank(0), core.rank(1)) == ((7, -5), None)
    core.insert_pending([b"k1"], [1], {}, lambda: 7)
    with pytest.raises(OverflowError, match=message):
        core.raise_to_request([b"k1"], {b"k1": -(2**63)}, 9)
    assert core.rank(1) == (1, 0) and (t.rank_major[1], t.rank_minor[1]) == (1, 0)
    core.close()


# --- Python code run inside a call (callbacks, keys' __hash__/__eq__): memory errors that
# --- AddressSanitizer found in both C types, fixed there (regression tests, both sides)

class Collider:
    """A key that hashes like ``hash_of`` and runs ``action`` whenever it is compared."""

    def __init__(self, hash_of, action):
        self.hash_value, self.action = hash(hash_of), action

    def __hash__(self):
        return self.hash_value

    def __eq__(self, other):
        self.action()
        return False


def _fresh_keys(count: int) -> list[bytes]:
    return [bytes(bytearray(b"key%d" % i)) for i in range(count)]


@pytest.mark.parametrize("impl", [_lru, lru_reference], ids=["C", "reference"])
def test_lru_callbacks_that_empty_the_lists_do_not_change_the_call(impl):
    """insert_pending and raise_to_request work on the lists as they were at the call: a
    positions callback that emptied them left the C with a freed key in hand and reading
    past the list's end (heap-use-after-free, then a crash)."""
    t = ChunkTable.private(8, 8)
    core = impl.LRUCore({}, t.rank_major, t.rank_minor, t.counters, NEXT_RANK)
    keys, rows = _fresh_keys(6), list(range(6))  # these lists hold the only references

    def empty_both(key):
        keys.clear()
        rows.clear()
    core.insert_pending(keys, rows, empty_both, lambda: 1)
    assert [core.rank(row) for row in range(6)] == [(i, 0) for i in range(1, 7)]
    core.close()
    keys = _fresh_keys(6)
    rows_dict = dict(zip(keys, range(6)))
    core = impl.LRUCore(rows_dict, t.rank_major, t.rank_minor, t.counters, NEXT_RANK)
    core.rebuild(t.refcnt)
    argument = list(keys)
    core.raise_to_request(argument, lambda key: argument.clear() or 3, 100)
    assert [core.rank(row) for row in range(6)] == [(100, -3)] * 6
    core.close()


@pytest.mark.parametrize("impl", [_rows, rows_reference], ids=["C", "reference"])
def test_a_lookup_that_empties_the_list_does_not_change_the_call(impl):
    """A rows-dict key whose __eq__ empties the caller's list (the only holder of the key
    being looked up) left classify appending a freed key."""
    t = ChunkTable.private(4, 8)
    rows: dict = {}
    index = impl.RowIndex(rows, t.keys, t.key_len, t.refcnt, t.tiers, 8)
    stored = _fresh_keys(3)
    index.claim(list(stored), [0, 1, 2])
    index.mark_stored(stored)
    probe = Probe(12345)
    argument = [probe, *stored]
    rows[Collider(probe, lambda: argument.clear())] = 3
    del probe
    absent, ready = index.classify(argument)
    assert repr(absent) == "[Probe()]" and ready == stored and argument == []
    index.close()


@pytest.mark.parametrize("impl", [_rows, rows_reference], ids=["C", "reference"])
def test_the_row_index_refuses_calls_from_inside_its_calls(impl):
    """A lookup that closed the index mid-call left the C writing through released
    buffers; now a call from inside a call is refused and the outer call fails with it."""
    t = ChunkTable.private(4, 8)
    rows: dict = {}
    index = impl.RowIndex(rows, t.keys, t.key_len, t.refcnt, t.tiers, 8)
    key = _fresh_keys(1)[0]
    index.claim([key], [0])
    rows[Collider(key + b"?", index.close)] = 1
    with pytest.raises(RuntimeError, match="row index closed from inside one of its own calls"):
        index.mark_stored([key, key + b"?"])
    rows[Collider(key + b"!", lambda: index.pin([key]))] = 2
    with pytest.raises(RuntimeError, match="row index called from inside one of its own calls"):
        index.classify([key + b"!"])
    assert index.ready_keys([key]) == [key]  # still open; the first key was marked stored
    index.close()


@pytest.mark.parametrize("impl", [_lru, lru_reference], ids=["C", "reference"])
def test_the_lru_core_refuses_calls_from_inside_its_calls(impl):
    """A positions callback that closed or cleared the core mid-call left the C writing
    ranks through released buffers and pushing forgotten keys; now refused."""
    t = ChunkTable.private(4, 8)
    keys = _fresh_keys(2)
    core = impl.LRUCore(dict(zip(keys, [0, 1])), t.rank_major, t.rank_minor, t.counters,
                        NEXT_RANK)
    for reenter in (core.close, core.clear, lambda: core.evict(1, set())):
        with pytest.raises(RuntimeError, match="LRU core called from inside one of its own"):
            core.insert_pending(list(keys), [0, 1], lambda key: reenter(), lambda: 1)
    core.insert_pending(list(keys), [0, 1], {}, lambda: 1)  # still open and usable
    core.mark_evictable(list(keys))
    assert core.evict(2, set()) == [(keys[0], 0), (keys[1], 1)]
    core.close()


@pytest.mark.parametrize("impl", [_rows, rows_reference], ids=["C", "reference"])
def test_a_key_whose_hex_is_not_a_str_is_named_by_its_str(impl):
    """The C formatted the result of key.hex() as a str without checking (a crash)."""
    class OddKey:
        def hex(self):
            return 12345

    t = ChunkTable.private(4, 8)
    index = impl.RowIndex({}, t.keys, t.key_len, t.refcnt, t.tiers, 8)
    with pytest.raises(KeyError, match="cannot load key 12345: it is not in the CPU tier"):
        index.pin([OddKey()])
    index.close()


@pytest.mark.parametrize("impl", [_rows, rows_reference], ids=["C", "reference"])
def test_first_accesses_holds_the_group_it_appends_to(impl):
    """``seen``'s lookups can run Python code that drops the group from ``groups``: the C
    appended to the freed list."""
    key = _fresh_keys(1)[0] + b"abcd"
    groups: dict = {}
    seen = {Collider(key, groups.clear)}
    assert impl.first_accesses([key], seen, groups, 4) == [key]
    assert key in seen and groups == {}
