"""The ledger of a storage tier's scheduler half: which state each chunk key is in, and
the bytes each state holds against the tier's ``max_bytes``.

Who calls: :class:`~shmtier.storage.scheduler.StorageTierManager`, in the scheduler
process, under the tiering manager's lock. Pure bookkeeping: no pool, no segment, no
I/O, never blocks; each method's work is in proportion to the keys it is given (the
eviction's walk starts at the LRU end). ``tests/test_storage_ledger.py`` drives it alone.

A key the tier knows of is in one of four states; "unknown" is the absence from all::

    unknown ──claim──▶ storing, queued (0 bytes) ──reserve──▶ storing (its reservation)
    storing ──answered: stored (or there already)──▶ indexed (the size the worker reports)
            ──answered: refused for space──▶ storing, queued (0 bytes) ──release──▶ unknown
            ──answered: ERROR (its worker died: is it there?)──▶ probing (the reservation)
            ──answered: failed / release──▶ unknown
    indexed ──evict──▶ deleting (its size) ──answered: gone──▶ unknown
                                ──answered: ERROR──▶ probing (its size)
    probing ──answered: found──▶ indexed (the size found) │ absent, given up──▶ unknown
    unknown ──adopt: a listing, or a lookup's probe, found it──▶ indexed (the size found)
    indexed ──lost: a load found it missing or corrupt; the namespace reset──▶ unknown
            ──unsure: a load answered ERROR (its worker may have removed the file,
              found corrupt, before it died); a listing did not list it──▶ probing

Invariants (``check`` asserts the first two; the stateful test checks all five):

1. A key is in at most one of ``index``, ``storing``, ``deleting``, ``probing``: no chunk
   is counted twice. A listing or a probe's answer never adopts a key in any state, nor
   one known gone since the listing was sent (``gone_since_listing``).
2. ``indexed_bytes``, ``reserved_bytes``, ``deleting_bytes`` and ``probing_bytes`` are
   the sums of their state's sizes; a store's reservation is 0 while it is queued and
   :meth:`reservation` once admitted. ``committed`` is their total: what the tier may
   hold on its medium at most right now.
3. :meth:`reserve` grants a reservation only while ``committed`` plus it stays within
   ``max_bytes``, and with a bound none before the listing has landed (``listed``: the
   bytes already on the medium are unknown until then).
4. No other transition raises ``committed``, but an adoption (a chunk found on the
   medium): an answered store replaces its reservation with the chunk's size (the workers
   never write a frame larger than its reservation: the raw chunk, the frame header and
   its MAC tag), an unknown outcome moves the same bytes to its probe, a failure or a
   confirmed delete releases them.
5. Every adoption evicts at once until ``indexed + reserved + probing <= max_bytes``
   (unless every chunk left in the index is being loaded: those are never evicted). So
   ``committed`` passes ``max_bytes`` only by chunks found on the medium, evicted and not
   yet confirmed deleted, and no store is admitted meanwhile.

The index keeps recency order (its LRU end first); the scheduler half reads the four
dicts directly on its hot paths (``lookup``, ``touch``) and moves keys to the recent
end, but changes states and sizes only through these methods.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from shmtier.contract import OffloadKey
from shmtier.shared.jobs import SUCCESS, Outcome

_STORED = SUCCESS["store"]  # written, or found there already
#: A probe whose worker died (or whose stat failed) is sent again, this many tries in all.
PROBE_TRIES = 4


class StorageLedger:
    """The states and byte counts of one storage tier's chunks. ``max_bytes``: the bound
    (None: unbounded); ``frame_bytes``: the largest frame of a key of length 0 (the raw
    chunk and the frame header, with its MAC tag where the tier has a MAC key)."""

    __slots__ = ("max_bytes", "frame_bytes", "index", "storing", "deleting", "probing",
                 "loading", "indexed_bytes", "reserved_bytes", "deleting_bytes",
                 "probing_bytes", "listed", "listing", "gone_since_listing",
                 "indexed_at_listing")

    def __init__(self, max_bytes: int | None, frame_bytes: int):
        self.max_bytes = max_bytes
        self.frame_bytes = frame_bytes
        self.index: OrderedDict[OffloadKey, int] = OrderedDict()  # on the medium: its size
        self.storing: dict[OffloadKey, int] = {}  # queued (0) or in flight (its reservation)
        self.deleting: dict[OffloadKey, int] = {}  # evicted, not confirmed gone: its size
        # a store or delete whose outcome is unknown: [bytes held, adopt at the LRU end, tries]
        self.probing: dict[OffloadKey, list] = {}
        self.loading: dict[OffloadKey, int] = {}  # indexed keys with loads in flight: count
        self.indexed_bytes = self.reserved_bytes = self.deleting_bytes = self.probing_bytes = 0
        self.listed = False  # a listing of the medium has landed (the index is complete)
        self.listing = False  # a listing is in flight
        # keys known gone (deleted, found missing or corrupt) since the listing in flight
        # was sent: it may have walked past them before
        self.gone_since_listing: set[OffloadKey] = set()
        # the keys indexed when the listing in flight was sent: one it does not list was
        # removed since (by hand, or by the listing itself as a foreign file)
        self.indexed_at_listing: set[OffloadKey] = set()

    # --- figures ---

    def reservation(self, key: OffloadKey) -> int:
        """The bytes a store of ``key`` reserves: its largest possible frame."""
        return self.frame_bytes + len(key)

    @property
    def committed(self) -> int:
        """Chunks, reservations, unconfirmed deletes and probes: at most ``max_bytes``
        but for adopted chunks being evicted (invariant 5)."""
        return self.indexed_bytes + self.deleting_bytes + self.reserved_bytes + self.probing_bytes

    @property
    def on_medium(self) -> int:
        """Bytes of the chunks known on the medium: indexed, or evicted and not gone yet."""
        return self.indexed_bytes + self.deleting_bytes

    @property
    def can_reserve(self) -> bool:
        """Whether stores may be admitted at all: unbounded, or the listing has landed."""
        return self.max_bytes is None or self.listed

    def knows(self, key: OffloadKey) -> bool:
        return (key in self.index or key in self.storing or key in self.deleting
                or key in self.probing)

    def state_of(self, key: OffloadKey) -> str:
        """"indexed", "storing", "deleting", "probing" or "unknown" (tests, logs)."""
        for name, where in (("indexed", self.index), ("storing", self.storing),
                            ("deleting", self.deleting), ("probing", self.probing)):
            if key in where:
                return name
        return "unknown"

    def bytes_besides(self, keys: Iterable[OffloadKey]) -> int:
        """``committed`` less the reservations of ``keys`` (in flight): what a store job of
        ``keys`` may find in use before its own chunks (the workers' own bound check)."""
        storing = self.storing
        return self.committed - sum(storing[key] for key in keys)

    # --- stores ---

    def claim(self, keys: Sequence[OffloadKey], rows: Sequence[Any]) -> tuple[list, list]:
        """Queue stores of those of ``keys`` the tier does not know (0 bytes until
        ``reserve``); returns them and their ``rows``. A key in any state is left to
        the job that has it: its bytes have one owner."""
        index, storing, deleting, probing = self.index, self.storing, self.deleting, self.probing
        claimed, claimed_rows = [], []
        for key, row in zip(keys, rows):
            if key in index or key in storing or key in deleting or key in probing:
                continue
            claimed.append(key)
            claimed_rows.append(row)
            storing[key] = 0
        return claimed, claimed_rows

    def reserve(self, keys: Sequence[OffloadKey]) -> int:
        """Reserve each queued key of ``keys``, in order, while it fits within
        ``max_bytes`` (invariant 3); returns how many did (a prefix of ``keys``)."""
        if not self.can_reserve:
            return 0
        limit = self.max_bytes
        room = None if limit is None else limit - self.committed
        storing, frame = self.storing, self.frame_bytes
        taken = reserved = 0
        for key in keys:
            need = frame + len(key)
            if room is not None:
                if need > room:
                    break
                room -= need
            storing[key] = need
            reserved += need
            taken += 1
        self.reserved_bytes += reserved
        return taken

    def release(self, keys: Iterable[OffloadKey]) -> None:
        """Stores of ``keys`` (queued or reserved) that go no further: unknown again."""
        storing = self.storing
        freed = 0
        for key in keys:
            freed += storing.pop(key, 0)
        self.reserved_bytes -= freed

    def stores_answered(self, keys: Sequence[OffloadKey], outcomes: Sequence[int],
                        sizes: Sequence[int], start: int) -> tuple[list, list[int], list]:
        """The workers' answers for the reserved stores of ``keys`` (their outcomes and
        stored sizes from index ``start`` of ``outcomes`` and ``sizes``). Returns the keys
        stored (indexed), the positions in ``keys`` of those refused for space (queued
        again, 0 bytes) and the keys whose outcome is unknown (ERROR: probing, their
        reservation held); any other key failed (unknown again)."""
        index, storing, probing = self.index, self.storing, self.probing
        stored: list[OffloadKey] = []
        again: list[int] = []
        unsure: list[OffloadKey] = []
        reserved = self.reserved_bytes
        added = held = 0
        for i, key in enumerate(keys):
            code = outcomes[start + i]
            need = storing.pop(key, 0)
            reserved -= need
            if code in _STORED:
                size = sizes[start + i]
                index[key] = size
                added += size
                stored.append(key)
            elif code == Outcome.REJECTED:
                storing[key] = 0
                again.append(i)
            elif code == Outcome.ERROR:
                probing[key] = [need, False, 0]
                held += need
                unsure.append(key)
        self.reserved_bytes = reserved
        self.indexed_bytes += added
        self.probing_bytes += held
        return stored, again, unsure

    # --- evictions and deletes ---

    def evict(self, need: int) -> list[OffloadKey]:
        """Move least recently used chunks not being loaded, worth ``need`` bytes, from
        the index to ``deleting`` (their bytes count until their deletes are confirmed);
        returns them, LRU first."""
        if need <= 0:
            return []
        victims = []
        freed = 0
        index, loading = self.index, self.loading
        for key, size in index.items():
            if freed >= need:
                break
            if key in loading:
                continue
            victims.append(key)
            freed += size
        deleting = self.deleting
        for key in victims:
            deleting[key] = index.pop(key)
        self.indexed_bytes -= freed
        self.deleting_bytes += freed
        return victims

    def make_room(self, want: int) -> list[OffloadKey]:
        """Evict so that ``want`` more bytes of reservations fit once the deletes in
        flight and those of the chunks evicted now are confirmed; returns the victims."""
        if self.max_bytes is None:
            return []
        return self.evict(want + self.committed - self.deleting_bytes - self.max_bytes)

    def deletes_answered(self, keys: Sequence[OffloadKey],
                         outcomes: Sequence[int]) -> list[OffloadKey]:
        """Deletes of evicted ``keys`` answered: gone (deleted, or not there) releases
        their bytes; an unknown outcome (ERROR) moves them to ``probing`` (adopted at the
        LRU end if found, to be evicted again). Returns the keys now probing."""
        deleting, probing = self.deleting, self.probing
        gone = self.gone_since_listing if self.listing else None
        unsure = []
        freed = held = 0
        for key, code in zip(keys, outcomes):
            size = deleting.pop(key, 0)
            freed += size
            if code == Outcome.OK or code == Outcome.MISS:
                if gone is not None:
                    gone.add(key)
            else:
                probing[key] = [size, True, 0]
                held += size
                unsure.append(key)
        self.deleting_bytes -= freed
        self.probing_bytes += held
        return unsure

    def forget(self, deletes: Iterable[OffloadKey], probes: Iterable[OffloadKey]) -> None:
        """Deletes and probes that will never be sent (the worker pool is broken): their
        keys are unknown again and their bytes no longer count."""
        deleting, probing = self.deleting, self.probing
        for key in deletes:
            self.deleting_bytes -= deleting.pop(key, 0)
        for key in probes:
            entry = probing.pop(key, None)
            if entry is not None:
                self.probing_bytes -= entry[0]

    # --- probes and adoptions ---

    def probes_answered(self, keys: Sequence[OffloadKey], outcomes: Sequence[int],
                        sizes: Sequence[int]) -> tuple[list, list, int, list]:
        """Probes of ``keys`` (stores or deletes whose outcome was unknown) answered: a
        chunk found is indexed with its size (a store's at the recent end, an evicted
        one's at the LRU end), one absent is forgotten, a probe that failed stays for
        another try (up to PROBE_TRIES in all) or is given up. Returns (adopted, to probe
        again, given up, evicted: invariant 5)."""
        probing, index = self.probing, self.index
        adopted, front, again = [], [], []
        given_up = 0
        for key, code, size in zip(keys, outcomes, sizes):
            entry = probing.get(key)
            if entry is None:
                continue
            if code == Outcome.ERROR and entry[2] + 1 < PROBE_TRIES:
                entry[2] += 1
                again.append(key)
                continue
            del probing[key]
            self.probing_bytes -= entry[0]
            if code == Outcome.OK:
                index[key] = size
                self.indexed_bytes += size
                adopted.append(key)
                if entry[1]:
                    front.append(key)
            elif code == Outcome.ERROR:
                given_up += 1
        for key in reversed(front):
            index.move_to_end(key, last=False)
        return adopted, again, given_up, self._evict_over_bound()

    def adopt(self, keys: Sequence[OffloadKey], sizes: Sequence[int]) -> tuple[list, list]:
        """Chunks a lookup's probe found on the medium: each key the tier does not know
        joins the index at its recent end (a request is about to load it). Returns
        (adopted, evicted: invariant 5)."""
        index, storing, deleting, probing = self.index, self.storing, self.deleting, self.probing
        adopted = []
        added = 0
        for key, size in zip(keys, sizes):
            if key in index or key in storing or key in deleting or key in probing:
                continue
            index[key] = size
            added += size
            adopted.append(key)
        self.indexed_bytes += added
        return adopted, self._evict_over_bound()

    def listing_sent(self) -> None:
        """A listing of the medium is in flight: note the keys gone from now on, and the
        keys indexed now (none after a start or a namespace reset, but those the reset's
        own answer stored)."""
        self.gone_since_listing.clear()
        self.indexed_at_listing = set(self.index)
        self.listing = True

    def listing_failed(self) -> None:
        """The listing in flight will not be adopted (failed, or the namespace reset)."""
        self.listing = False
        self.gone_since_listing.clear()
        self.indexed_at_listing = set()

    def adopt_listing(self, keys: Sequence[OffloadKey],
                      sizes: Sequence[int]) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """A listing landed: each chunk it found that the tier does not know, and that is
        not known gone since the listing was sent, joins the index as older than anything
        stored since. A key indexed when the listing was sent, still indexed and not
        listed, had its file removed meanwhile (by hand, or by the listing itself as a
        foreign file: ``fs`` removes a file too big for a chunk): it is probed
        (``unsure``), never kept on trust. The index is complete from now on. Returns
        (the evicted keys (invariant 5), the keys now probing)."""
        index, storing, deleting, probing = self.index, self.storing, self.deleting, self.probing
        gone = self.gone_since_listing
        before = self.indexed_at_listing
        unlisted = []
        if before:
            listed = set(keys)
            unlisted = [k for k in before if k in index and k not in listed]
        added = 0
        for key, size in zip(keys, sizes):
            if (key in index or key in storing or key in deleting or key in probing
                    or key in gone):
                continue
            index[key] = size
            index.move_to_end(key, last=False)
            added += size
        self.indexed_bytes += added
        self.listed = True
        self.listing_failed()  # (no listing in flight any more)
        unsure = self.unsure(unlisted) if unlisted else []
        return self._evict_over_bound(), unsure

    def _evict_over_bound(self) -> list[OffloadKey]:
        if self.max_bytes is None:
            return []
        return self.evict(self.indexed_bytes + self.reserved_bytes + self.probing_bytes
                          - self.max_bytes)

    # --- losses ---

    def lost(self, key: OffloadKey) -> None:
        """A load found ``key``'s chunk missing or corrupt (removed): unknown again."""
        size = self.index.pop(key, None)
        if size is not None:
            self.indexed_bytes -= size
        if self.listing:
            self.gone_since_listing.add(key)

    def clear_index(self) -> list[OffloadKey]:
        """The tier's namespace was removed or made anew: every indexed chunk is unknown
        again, and the medium must be listed again. Returns the keys dropped."""
        dropped = list(self.index)
        self.index.clear()
        self.indexed_bytes = 0
        self.listed = False
        self.listing_failed()
        return dropped

    # --- loads in flight (never evicted) ---

    def loads_sent(self, keys: Iterable[OffloadKey]) -> None:
        loading = self.loading
        for key in keys:
            loading[key] = loading.get(key, 0) + 1

    def loads_done(self, keys: Iterable[OffloadKey]) -> None:
        loading = self.loading
        for key in keys:
            count = loading.get(key, 0) - 1
            if count > 0:
                loading[key] = count
            else:
                loading.pop(key, None)

    def unsure(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Whether the chunks of indexed ``keys`` are still on the medium is unknown: a
        load of theirs ended in ERROR (a worker removes a file it finds corrupt or
        foreign, and may die before it answers), or a listing did not list them
        (``adopt_listing``). Each key still indexed moves to ``probing`` (its size;
        adopted at the recent end if found). Returns the keys now probing."""
        index, probing = self.index, self.probing
        unsure = []
        moved = 0
        for key in keys:
            size = index.pop(key, None)
            if size is None or key in probing:
                continue
            probing[key] = [size, False, 0]
            moved += size
            unsure.append(key)
        self.indexed_bytes -= moved
        self.probing_bytes += moved
        return unsure

    # --- checks ---

    def check(self) -> None:
        """Assert invariants 1 and 2 (O(keys): tests and debugging only)."""
        states = (self.index, self.storing, self.deleting, self.probing)
        total = sum(len(s) for s in states)
        every = set().union(*states)
        if len(every) != total:
            twice = [k for k in every if sum(k in s for s in states) > 1]
            raise AssertionError(f"keys in two states: {twice[:5]!r}")
        for name, got, want in (
                ("indexed_bytes", self.indexed_bytes, sum(self.index.values())),
                ("reserved_bytes", self.reserved_bytes, sum(self.storing.values())),
                ("deleting_bytes", self.deleting_bytes, sum(self.deleting.values())),
                ("probing_bytes", self.probing_bytes, sum(e[0] for e in self.probing.values()))):
            if got != want:
                raise AssertionError(f"{name} is {got}, its state holds {want}")
        for key, need in self.storing.items():
            if need not in (0, self.reservation(key)):
                raise AssertionError(f"store of {key!r} reserves {need}, not 0 or "
                                     f"{self.reservation(key)}")
        for key, entry in self.probing.items():
            if not 0 <= entry[2] < PROBE_TRIES:
                raise AssertionError(f"probe of {key!r} at try {entry[2]}")
        if any(count <= 0 for count in self.loading.values()):
            raise AssertionError("a load count at or below 0")

    def __repr__(self) -> str:
        return (f"StorageLedger(indexed={len(self.index)}/{self.indexed_bytes}, "
                f"storing={len(self.storing)}/{self.reserved_bytes}, "
                f"deleting={len(self.deleting)}/{self.deleting_bytes}, "
                f"probing={len(self.probing)}/{self.probing_bytes}, "
                f"max_bytes={self.max_bytes})")
