"""Plain value types of the offloading contract (vLLM 0.33 ``v1/kv_offload/base.py``).

Every process imports these: the scheduler (managers, policies), GPU workers
(copy worker) and the vLLM adapter, which converts them to vLLM's own classes at
the boundary. They are plain, picklable and import neither torch nor vLLM.

Keys: an :data:`OffloadKey` is raw ``bytes`` = block hash || uint32 big-endian
KV-cache group index. Bytes rather than tuples keep the per-key cost low (no GC
tracking); the helpers below are the only code that knows the layout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar

import numpy as np

OffloadKey = bytes
GROUP_SUFFIX_LEN = 4

_T = TypeVar("_T")


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack ``block_hash`` and ``group_idx`` into one key."""
    return block_hash + group_idx.to_bytes(GROUP_SUFFIX_LEN, "big", signed=False)


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block hash part of ``key`` (all but the last four bytes)."""
    return key[:-GROUP_SUFFIX_LEN]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index of ``key`` (its last four bytes, big-endian)."""
    return int.from_bytes(key[-GROUP_SUFFIX_LEN:], "big", signed=False)


class Medium(enum.Enum):
    """Storage medium of a tier, as reported in events and tier filters."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(enum.Enum):
    """Where a tier's storage lives relative to this instance."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class CacheHitSource(enum.Enum):
    """Where a hit was served from; ordered from nearest to outermost."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


def _same(a: Any, b: Any) -> bool:
    """Wildcard (None) on either side, or equal enum *values* (so vLLM's enum
    members match shmtier's)."""
    return a is None or b is None or a.value == b.value


class TierMatcher(NamedTuple):
    """Matches a tier when each field is a wildcard (None) on either side or equal."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | None, locality: Locality | None) -> bool:
        return _same(self.medium, medium) and _same(self.locality, locality)


def tier_filter_allows(tier_filter: Any, medium: Medium | None, locality: Locality | None) -> bool:
    """Whether ``tier_filter`` lets a tier of (``medium``, ``locality``) serve loads.

    Accepts shmtier's :class:`TierFilter` and vLLM's (same shape, other enum
    classes): its ``ALL`` allows everything, otherwise any matcher must match
    by value. The one place where tier filters are evaluated."""
    if tier_filter is getattr(type(tier_filter), "ALL", None):
        return True
    return any(_same(m.medium, medium) and _same(m.locality, locality)
               for m in tier_filter.matchers)


@dataclass(frozen=True)
class TierFilter:
    """Which secondary tiers may serve loads for a request (``ALL``: any)."""

    matchers: tuple[TierMatcher, ...] = ()
    ALL: ClassVar["TierFilter"]

    def allows(self, medium: Medium | None, locality: Locality | None) -> bool:
        return tier_filter_allows(self, medium, locality)


TierFilter.ALL = TierFilter(matchers=(TierMatcher(),))


@dataclass
class ReqContext:
    """One request as the managers see it; the same object for every call.

    Two private maps ride along: typed scratch state (``set_state`` stores an
    object under its type, so a manager or policy can cache per-request data)
    and the end-token position of every key the scheduler derived, from which
    head-to-tail order is recovered when stores arrive out of order.

    The token counts are vLLM 0.34's (live until the request finishes, then
    frozen; None where not known): vLLM's own ``ReqContext`` reaches the core as it
    is, so a tier reads them the same way from either; this class answers None.
    """

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    kv_hints: Any = None
    load_tier_filter: TierFilter = TierFilter.ALL
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)
    _offload_key_positions: dict[OffloadKey, int] = field(
        default_factory=dict, repr=False, init=False
    )

    @property
    def num_computed_tokens(self) -> int | None:
        return None

    @property
    def num_in_flight_tokens(self) -> int | None:
        return None

    @property
    def num_prompt_tokens(self) -> int | None:
        return None

    @property
    def num_tokens(self) -> int | None:
        return None

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type[_T]) -> _T | None:
        return self._state.get(cls)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._offload_key_positions.get(key)


class LookupResult(enum.Enum):
    """``HIT``: readable now. ``HIT_PENDING``: present, not yet readable (ask
    again). ``RETRY``: location not known yet (ask again). ``MISS``: absent."""

    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()
    RETRY = enum.auto()


class OffloadPolicy(enum.Enum):
    """Per-request offload scope."""

    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestOffloadingContext:
    """What ``on_new_request`` returns."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


class ScheduleEndContext(NamedTuple):
    """Argument of ``on_schedule_end``: requests new and preempted this step."""

    new_req_ids: Any
    preempted_req_ids: Any


class LoadStoreSpec:
    """Opaque description of where a transfer reads or writes."""


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """A spec addressing blocks by integer id: ``block_ids``, an ``np.int32`` array, and
    ``ids``, the same ids as a list of ints.

    ``of_ids(ids)`` (the CPU tier's specs, the tiering manager's jobs) takes over a list
    and builds the array on the first read of ``block_ids``. The scheduler never reads
    the specs it hands out: the connector passes them to the GPU workers, whose copy
    reads them, so the array is built there (cold, one costs 20-40 µs of
    scheduler-thread time per call); shmtier's own tiers read ``ids``."""

    def __init__(self, block_ids: Any):
        self._list: list[int] | None = None
        self._array: np.ndarray | None = np.asarray(block_ids, dtype=np.int32)

    @classmethod
    def of_ids(cls, ids: list[int]):
        """A spec over ``ids``, which the caller hands over (must not change it after)."""
        spec = cls.__new__(cls)
        spec._list, spec._array = ids, None
        return spec

    @property
    def block_ids(self) -> np.ndarray:
        if self._array is None:
            self._array = np.asarray(self._list, dtype=np.int32)
        return self._array

    @block_ids.setter
    def block_ids(self, block_ids: Any) -> None:  # as vLLM's plain attribute allows
        self._list, self._array = None, np.asarray(block_ids, dtype=np.int32)

    @property
    def ids(self) -> list[int]:
        """``block_ids`` as a list of ints."""
        if self._list is None:
            self._list = self._array.tolist()
        return self._list

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU side of a transfer: block ids ordered by KV group.

    ``group_sizes[g]`` blocks belong to group ``g`` (they sum to
    ``len(block_ids)``); ``block_indices[g]`` is the logical index, within the
    request and counted in GPU blocks, of group ``g``'s first block, so the
    copier can skip the leading part of a chunk that starts mid-chunk.
    """

    def __init__(self, block_ids: Any, group_sizes: Any, block_indices: Any):
        super().__init__(block_ids)
        self.group_sizes = tuple(int(s) for s in group_sizes)
        self.block_indices = tuple(int(i) for i in block_indices)
        if sum(self.group_sizes) != len(self.block_ids):
            raise ValueError(
                f"group_sizes {self.group_sizes} sum to {sum(self.group_sizes)}, "
                f"but there are {len(self.block_ids)} block ids"
            )
        if len(self.block_indices) != len(self.group_sizes):
            raise ValueError(
                f"block_indices has {len(self.block_indices)} entries, "
                f"group_sizes has {len(self.group_sizes)}: need one per group"
            )


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """CPU side of a transfer: ids are arena row (chunk slot) indices."""

    @property
    def chunk_ids(self) -> np.ndarray:
        return self.block_ids


@dataclass
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """Keys stored in or removed from one tier.

    ``ownership`` names the secondary tier (None for the primary);
    ``metadata_only`` marks clean-up after a failed store, not a public eviction;
    ``req_context`` is the request whose store or failed store made the event, where
    one did (vLLM 0.34 describes stored chunks from it).
    """

    keys: list[OffloadKey]
    medium: Medium
    removed: bool
    locality: Locality | None = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False
    req_context: ReqContext | None = field(default=None, repr=False, compare=False)


@dataclass
class TransferResult:
    """One finished copy job as a GPU worker reports it."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
