"""The storage tiers' ledger (``shmtier/storage/ledger.py``) on its own, without a pool,
a segment or a medium: each key in one state, the byte counts the sums of their states,
reservations only within ``max_bytes``, adoptions evicted back under it."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmtier.shared.jobs import Outcome
from shmtier.storage.ledger import PROBE_TRIES, StorageLedger

FRAME = 100  # a chunk's largest frame with a key of length 0
OK, MISS, ERROR, REJECTED, EXISTS, INVALID = (Outcome.OK, Outcome.MISS, Outcome.ERROR,
                                              Outcome.REJECTED, Outcome.EXISTS, Outcome.INVALID)


def listed(max_bytes: int | None) -> StorageLedger:
    ledger = StorageLedger(max_bytes, FRAME)
    ledger.listing_sent()
    assert ledger.adopt_listing([], []) == ([], [])
    return ledger


def test_a_store_reserves_only_what_fits_and_only_once_the_medium_is_listed():
    ledger = StorageLedger(250, FRAME)
    keys, rows = ledger.claim([b"a", b"b", b"a", b"c"], [1, 2, 3, 4])
    assert (keys, rows) == ([b"a", b"b", b"c"], [1, 2, 4])  # a key queued once
    assert ledger.reserve(keys) == 0  # the bytes on the medium are unknown yet
    ledger.listing_sent()
    ledger.adopt_listing([], [])
    assert ledger.reserve(keys) == 2  # 101 + 101 of 250
    assert ledger.storing == {b"a": 101, b"b": 101, b"c": 0}
    assert ledger.committed == 202
    assert ledger.make_room(101) == []  # nothing indexed to evict
    ledger.release([b"c"])
    assert ledger.state_of(b"c") == "unknown" and ledger.committed == 202
    ledger.check()


def test_answered_stores_move_each_key_by_its_outcome():
    ledger = listed(None)
    keys, _ = ledger.claim([b"a", b"b", b"c", b"d", b"e"], range(5))
    assert ledger.reserve(keys) == 5
    # the outcomes of this job's keys start at index 1 (another job's before them)
    stored, again, unsure = ledger.stores_answered(
        keys, [OK, OK, EXISTS, REJECTED, ERROR, INVALID], [9, 80, 70, 0, 0, 0], 1)
    assert (stored, again, unsure) == ([b"a", b"b"], [2], [b"d"])
    assert ledger.index == {b"a": 80, b"b": 70}
    assert ledger.storing == {b"c": 0}  # refused for space: queued again, nothing held
    assert ledger.probing == {b"d": [101, False, 0]}  # unknown: its reservation held
    assert ledger.state_of(b"e") == "unknown"
    assert (ledger.indexed_bytes, ledger.reserved_bytes, ledger.probing_bytes) == (150, 0, 101)
    ledger.check()


def test_eviction_takes_the_least_recent_chunks_that_are_not_being_loaded():
    ledger = listed(None)
    ledger.adopt([b"a", b"b", b"c"], [10, 20, 30])
    ledger.loads_sent([b"a"])
    assert ledger.evict(25) == [b"b", b"c"]  # "a" is being loaded
    assert ledger.deleting == {b"b": 20, b"c": 30} and ledger.on_medium == 60
    ledger.loads_done([b"a"])
    assert ledger.deletes_answered([b"b", b"c"], [OK, ERROR]) == [b"c"]
    assert ledger.probing == {b"c": [30, True, 0]} and ledger.on_medium == 10
    # a probe that fails is sent again, then given up (forgotten); one found goes to the
    # LRU end, to be evicted again
    ledger.index[b"z"] = 5
    ledger.indexed_bytes += 5
    for _ in range(PROBE_TRIES - 1):
        assert ledger.probes_answered([b"c"], [ERROR], [0])[1] == [b"c"]
    assert ledger.probes_answered([b"c"], [OK], [31]) == ([b"c"], [], 0, [])
    assert list(ledger.index) == [b"c", b"a", b"z"]
    ledger.evict(1)
    ledger.deletes_answered([b"c"], [ERROR])
    for _ in range(PROBE_TRIES - 1):
        ledger.probes_answered([b"c"], [ERROR], [0])
    assert ledger.probes_answered([b"c"], [ERROR], [0]) == ([], [], 1, [])  # given up
    assert ledger.state_of(b"c") == "unknown" and ledger.probing_bytes == 0
    ledger.check()


def test_a_listing_leaves_keys_in_flight_and_keys_gone_since_it_was_sent():
    ledger = StorageLedger(300, FRAME)
    ledger.listing_sent()
    ledger.claim([b"s"], [0])  # a store queued
    ledger.adopt([b"g"], [50])  # a lookup's probe found it ...
    ledger.lost(b"g")  # ... and a load found it corrupt: the listing may predate that
    evicted, unsure = ledger.adopt_listing([b"s", b"g", b"x", b"y", b"w"], [1, 2, 150, 150, 150])
    assert ledger.listed and not ledger.gone_since_listing
    # 450 bytes listed: the least recent chunks go until 300 hold (x, listed first, is
    # the oldest after the LRU-end inserts: w, y, x)
    assert evicted == [b"w"] and list(ledger.index) == [b"y", b"x"]
    assert ledger.committed == 450 and ledger.indexed_bytes == 300
    assert ledger.reserve([b"s"]) == 0  # no room until the delete is confirmed
    ledger.deletes_answered(evicted, [OK])
    assert ledger.committed == 300 and not ledger.gone_since_listing  # no listing now
    ledger.check()


def test_a_key_indexed_before_the_listing_and_not_in_it_is_probed():
    """A chunk indexed when the listing was sent that the listing does not list had its
    file removed meanwhile (by hand, or by the listing as a foreign file): probed, with
    its bytes held, never kept on trust; one indexed after the listing was sent is
    kept (the walk may have passed its directory before it was written)."""
    ledger = listed(None)
    ledger.adopt([b"a", b"b"], [10, 20])
    ledger.listing_sent()
    ledger.adopt([b"late"], [30])
    evicted, unsure = ledger.adopt_listing([b"a", b"x"], [10, 40])
    assert evicted == [] and unsure == [b"b"]
    assert set(ledger.index) == {b"a", b"x", b"late"} and ledger.probing[b"b"][0] == 20
    assert ledger.committed == 10 + 40 + 30 + 20
    ledger.check()


def test_a_namespace_reset_drops_the_index_and_asks_for_a_listing():
    ledger = listed(1000)
    ledger.adopt([b"a", b"b"], [10, 20])
    assert ledger.clear_index() == [b"a", b"b"]
    assert not ledger.listed and ledger.indexed_bytes == 0 and not ledger.can_reserve
    ledger.check()


def test_check_names_a_broken_invariant():
    ledger = listed(None)
    ledger.adopt([b"a"], [10])
    ledger.storing[b"a"] = 0
    with pytest.raises(AssertionError, match="two states"):
        ledger.check()
    del ledger.storing[b"a"]
    ledger.indexed_bytes += 1
    with pytest.raises(AssertionError, match="indexed_bytes is 11, its state holds 10"):
        ledger.check()


# --- random sequences of transitions ---

KEYS = [b"k%d" % i + b"x" * (i % 4) for i in range(12)]  # reservations 103..106
STATES = ("indexed", "storing", "deleting", "probing", "unknown")
#: every change of state the ledger may make (its docstring's diagram)
ALLOWED = {("unknown", "storing"), ("storing", "indexed"), ("storing", "probing"),
           ("storing", "unknown"), ("indexed", "deleting"), ("deleting", "unknown"),
           ("deleting", "probing"), ("probing", "indexed"), ("probing", "unknown"),
           ("unknown", "indexed"), ("indexed", "unknown"),
           # a load answered ERROR: its worker may have removed the file before dying
           ("indexed", "probing"),
           # an adoption's eviction may take the chunk just adopted (in one call)
           ("unknown", "deleting"), ("probing", "deleting")}
some_keys = st.lists(st.sampled_from(KEYS), max_size=6)


class LedgerMachine(RuleBasedStateMachine):
    """Random transitions, as the tier's results could bring them in any order. After
    each: ``check`` (one state per key, counters = sums), each key moved only along the
    diagram, and the bound: a reservation granted only within ``max_bytes``; no
    transition but an adoption raises ``committed``; an adoption evicts at once until
    ``indexed + reserved + probing <= max_bytes`` (but for chunks being loaded), so
    ``committed`` passes the bound only by chunks being deleted."""

    def __init__(self):
        super().__init__()
        self.ledger: StorageLedger | None = None
        self.states = dict.fromkeys(KEYS, "unknown")
        self.overshoot = 0  # what adoptions put over max_bytes, as their deletes settle
        self.before = 0

    @rule(max_bytes=st.one_of(st.none(), st.integers(150, 800)))
    @precondition(lambda self: self.ledger is None)
    def start(self, max_bytes):
        self.ledger = StorageLedger(max_bytes, FRAME)

    def _own(self) -> None:
        """Before a transition that must not raise ``committed``."""
        self.before = self.ledger.committed

    def _not_raised(self) -> None:
        assert self.ledger.committed <= self.before

    def _adopted(self) -> None:
        ledger = self.ledger
        if ledger.max_bytes is None:
            return
        settled = ledger.indexed_bytes + ledger.reserved_bytes + ledger.probing_bytes
        assert settled <= ledger.max_bytes or all(k in ledger.loading for k in ledger.index)
        self.overshoot = max(0, ledger.committed - ledger.max_bytes)

    def _keys_in(self, *states: str) -> list[bytes]:
        return [k for k in KEYS if self.ledger.state_of(k) in states]

    @rule(keys=some_keys)
    @precondition(lambda self: self.ledger is not None)
    def claim(self, keys):
        self._own()
        claimed, rows = self.ledger.claim(keys, keys)
        assert claimed == rows and len(set(claimed)) == len(claimed)
        assert all(self.ledger.storing[k] == 0 for k in claimed)
        self._not_raised()

    @rule(data=st.data())
    @precondition(lambda self: self.ledger is not None)
    def reserve(self, data):
        queued = [k for k, need in self.ledger.storing.items() if need == 0]
        keys = data.draw(st.permutations(queued))
        ledger = self.ledger
        before = ledger.committed
        taken = ledger.reserve(keys)
        if ledger.max_bytes is not None:
            if not ledger.listed:
                assert taken == 0
            if taken:
                assert ledger.committed <= ledger.max_bytes
            if taken < len(keys) and ledger.listed:  # the next one did not fit
                assert before + sum(map(ledger.reservation, keys[:taken + 1])) > ledger.max_bytes
        assert all(ledger.storing[k] == ledger.reservation(k) for k in keys[:taken])

    @rule(data=st.data())
    @precondition(lambda self: self.ledger is not None)
    def release(self, data):
        keys = data.draw(st.lists(st.sampled_from(KEYS)))
        self._own()
        stores = [k for k in keys if k in self.ledger.storing]
        self.ledger.release(keys)
        assert all(self.ledger.state_of(k) == "unknown" for k in stores)
        self._not_raised()

    @rule(data=st.data())
    @precondition(lambda self: self.ledger is not None
                  and any(self.ledger.storing.values()))
    def stores_answered(self, data):
        ledger = self.ledger
        keys = data.draw(st.lists(st.sampled_from(
            [k for k, need in ledger.storing.items() if need]), min_size=1, unique=True))
        outcomes = data.draw(st.lists(st.sampled_from([OK, EXISTS, REJECTED, ERROR, INVALID]),
                                      min_size=len(keys), max_size=len(keys)))
        # a frame is never larger than its reservation
        sizes = [data.draw(st.integers(1, ledger.reservation(k))) for k in keys]
        self._own()
        stored, again, unsure = ledger.stores_answered(keys, outcomes, sizes, 0)
        assert [ledger.index[k] for k in stored] == [s for s, c in zip(sizes, outcomes)
                                                     if c in (OK, EXISTS)]
        assert all(ledger.storing[keys[i]] == 0 for i in again)
        assert all(ledger.probing[k][0] == ledger.reservation(k) for k in unsure)
        self._not_raised()

    @rule(need=st.integers(-10, 500))
    @precondition(lambda self: self.ledger is not None)
    def evict(self, need):
        self._own()
        victims = self.ledger.evict(need)
        assert not set(victims) & set(self.ledger.loading)
        self._not_raised()

    @rule(want=st.integers(0, 400))
    @precondition(lambda self: self.ledger is not None)
    def make_room(self, want):
        self._own()
        self.ledger.make_room(want)
        self._not_raised()

    @rule(data=st.data())
    @precondition(lambda self: self.ledger is not None and self.ledger.deleting)
    def deletes_answered(self, data):
        keys = data.draw(st.lists(st.sampled_from(list(self.ledger.deleting)), min_size=1,
                                  unique=True))
        outcomes = data.draw(st.lists(st.sampled_from([OK, MISS, ERROR]), min_size=len(keys),
                                      max_size=len(keys)))
        self._own()
        unsure = self.ledger.deletes_answered(keys, outcomes)
        assert unsure == [k for k, c in zip(keys, outcomes) if c == ERROR]
        self._not_raised()

    @rule(data=st.data())
    @precondition(lambda self: self.ledger is not None)
    def probes_answered(self, data):
        # answers for keys probing, and stale ones (a key no longer probing: ignored)
        keys = data.draw(st.lists(st.sampled_from(KEYS), unique=True))
        outcomes = data.draw(st.lists(st.sampled_from([OK, MISS, ERROR]), min_size=len(keys),
                                      max_size=len(keys)))
        sizes = [data.draw(st.integers(1, self.ledger.reservation(k))) for k in keys]
        before = {k: self.ledger.state_of(k) for k in keys}
        adopted, again, _, _ = self.ledger.probes_answered(keys, outcomes, sizes)
        assert all(before[k] == "probing" for k in adopted + again)
        self._adopted()

    @rule(keys=some_keys, size=st.integers(1, 106))
    @precondition(lambda self: self.ledger is not None)
    def adopt(self, keys, size):
        known = {k for k in keys if self.ledger.knows(k)}
        adopted, _ = self.ledger.adopt(keys, [size] * len(keys))
        assert not known & set(adopted)
        self._adopted()

    @rule()
    @precondition(lambda self: self.ledger is not None)
    def listing_sent(self):
        self.ledger.listing_sent()

    @rule()
    @precondition(lambda self: self.ledger is not None)
    def listing_failed(self):
        self._own()
        self.ledger.listing_failed()
        self._not_raised()

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True), size=st.integers(1, 106))
    @precondition(lambda self: self.ledger is not None and self.ledger.listing)
    def adopt_listing(self, keys, size):
        ledger = self.ledger
        left = {k for k in keys if ledger.knows(k) or k in ledger.gone_since_listing}
        before = {k: ledger.index.get(k) for k in left}
        unlisted = {k for k in ledger.indexed_at_listing if k in ledger.index and k not in keys}
        _, unsure = ledger.adopt_listing(keys, [size] * len(keys))
        assert ledger.listed and not ledger.listing
        assert all(ledger.index.get(k) == before[k] for k in left if k not in ledger.deleting)
        assert set(unsure) == unlisted and all(k in ledger.probing for k in unlisted)
        self._adopted()

    @rule(key=st.sampled_from(KEYS))
    @precondition(lambda self: self.ledger is not None)
    def lost(self, key):
        self._own()
        self.ledger.lost(key)
        assert key not in self.ledger.index
        self._not_raised()

    @rule()
    @precondition(lambda self: self.ledger is not None)
    def clear_index(self):
        self._own()
        self.ledger.clear_index()
        assert not self.ledger.index and not self.ledger.listed
        self._not_raised()

    @rule(data=st.data())
    @precondition(lambda self: self.ledger is not None and self.ledger.index)
    def loads(self, data):
        keys = data.draw(st.lists(st.sampled_from(list(self.ledger.index)), min_size=1))
        self.ledger.loads_sent(keys)
        if data.draw(st.booleans()):
            self.ledger.loads_done(keys)

    @rule(data=st.data())
    @precondition(lambda self: self.ledger is not None and self.ledger.loading)
    def loads_done(self, data):
        self.ledger.loads_done(data.draw(st.lists(st.sampled_from(list(self.ledger.loading)),
                                                  unique=True)))

    @rule(data=st.data())
    @precondition(lambda self: self.ledger is not None and self.ledger.loading)
    def unsure(self, data):
        """Loads answered ERROR: their keys still indexed are probed, their sizes kept."""
        keys = data.draw(st.lists(st.sampled_from(list(self.ledger.loading)), unique=True))
        sizes = {k: self.ledger.index[k] for k in keys if k in self.ledger.index}
        self.ledger.loads_done(keys)
        self._own()
        moved = self.ledger.unsure(keys)
        assert sorted(moved) == sorted(sizes)
        assert all(self.ledger.probing[k][0] == sizes[k] and k not in self.ledger.index
                   for k in moved)
        self._not_raised()

    @rule(key=st.sampled_from(KEYS))
    @precondition(lambda self: self.ledger is not None)
    def touch(self, key):
        if key in self.ledger.index:  # the scheduler's lookups and touches
            self.ledger.index.move_to_end(key)

    @rule(data=st.data())
    @precondition(lambda self: self.ledger is not None)
    def forget(self, data):
        deletes = data.draw(st.lists(st.sampled_from(list(self.ledger.deleting) or KEYS)))
        probes = data.draw(st.lists(st.sampled_from(list(self.ledger.probing) or KEYS)))
        self._own()
        self.ledger.forget(deletes, probes)
        self._not_raised()

    @invariant()
    def one_state_per_key_and_counts_that_add_up(self):
        if self.ledger is None:
            return
        self.ledger.check()
        for key in KEYS:
            now = self.ledger.state_of(key)
            assert now in STATES
            was = self.states[key]
            assert was == now or (was, now) in ALLOWED, f"{key!r}: {was} -> {now}"
            self.states[key] = now

    @invariant()
    def committed_stays_within_max_bytes_but_for_adopted_chunks_being_deleted(self):
        ledger = self.ledger
        if ledger is None or ledger.max_bytes is None:
            return
        over = ledger.committed - ledger.max_bytes
        assert over <= self.overshoot, (over, self.overshoot, ledger)
        self.overshoot = max(0, over)


LedgerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60,
                                           deadline=None)
TestLedger = LedgerMachine.TestCase
