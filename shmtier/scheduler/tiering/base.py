"""The secondary-tier interface, signature-compatible with vLLM 0.33's (docs/vllm-contract.md §7).

Who calls: the tiering manager, in the scheduler process, always under its
lock (never concurrently, not always from the same thread). Every method must
be non-blocking except ``drain_jobs``. Data moves only through the primary
tier: a cascade reads pinned primary rows (``job.chunk_ids``), a promotion
writes reserved primary rows.

A tier written against vLLM's ``SecondaryTierManager`` runs unchanged: the
manager only uses the attributes and methods below (duck typing), and
:class:`TransferJob`/:class:`JobResult` carry vLLM's field names.

Adding a built-in tier type ``t`` (docs/architecture.md, "Adding a tier"):

1. ``shmtier/tiers/t/config.py``: a frozen ``TierConfig`` subclass declaring each
   option with its check (every invalid value then fails when the spec is built);
2. ``shmtier/tiers/t/scheduler.py``: a subclass of this class, constructed with
   ``config=`` that config; it never blocks and never does I/O itself when it has
3. ``shmtier/tiers/t/backend.py``: a ``shmtier.tiers.backend.TierBackend`` that does
   the tier's I/O in the tier worker processes (the scheduler half submits its jobs
   to ``offloading_spec.worker_pool`` under its index ``tier_index_being_built``);
4. one ``TierType`` line in ``shmtier/tiers/registry.py``.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NewType

import numpy as np

from shmtier.contract import (
    CacheHitSource,
    CPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

#: The tiering manager's id of one tier job (vLLM's ``JobId``): a cascade or promotion
#: of one tier, ``TransferJob.job_id`` and ``JobResult.job_id``. A worker-backed tier
#: sends tier jobs to the worker pool combined, under a pool job id
#: (``shmtier.scheduler.pool.PoolJobId``), whose parts travel under wire ids
#: (``shmtier.shared.jobs.WireJobId``).
JobId = NewType("JobId", int)
TIER_LABEL = "tier"


class TransferJob:
    """An in-flight cascade (``is_promotion=False``: read ``chunk_ids``) or
    promotion (write ``chunk_ids``); ``keys`` and ``chunk_ids`` are parallel.

    ``chunk_ids`` is vLLM's int32 array, built on first use from the row list the
    manager hands over (a ``CPULoadStoreSpec.of_ids``); built-in tiers read ``rows``
    (that list) and skip numpy: converting a short list costs ~11 µs of a step once
    the caches are cold."""

    __slots__ = ("job_id", "keys", "is_promotion", "req_context", "submit_time", "_spec")

    def __init__(self, job_id: JobId, keys: Collection[OffloadKey], chunk_ids: Any,
                 is_promotion: bool, req_context: ReqContext, submit_time: float | None = None):
        self.job_id = job_id
        self.keys = keys
        self.is_promotion = is_promotion
        self.req_context = req_context
        self.submit_time = time.monotonic() if submit_time is None else submit_time
        self._spec = (CPULoadStoreSpec.of_ids(chunk_ids) if isinstance(chunk_ids, list)
                      else CPULoadStoreSpec(chunk_ids))

    @property
    def chunk_ids(self) -> np.ndarray:
        return self._spec.block_ids

    @property
    def rows(self) -> list[int]:
        """``chunk_ids`` as a list of ints."""
        return self._spec.ids

    def __repr__(self) -> str:
        kind = "promotion" if self.is_promotion else "cascade"
        return f"TransferJob({self.job_id}, {kind}, {len(self.keys)} keys, rows {self.rows})"


@dataclass
class JobResult:
    """The one report of a submitted job. ``successful_keys`` (promotions only)
    lists the keys that did land when ``success`` is False; None means none.

    ``deferred_release`` (vLLM 0.34's field; failed promotions only): set when the
    tier's I/O may still write the primary rows of the failed keys. The manager fails
    those keys at once but keeps their rows out of the free pool until the tier sets
    the event (from any thread), once nothing of its I/O can touch them any more
    (``deferred_release.py``). ``drain_jobs`` returns only with every such event set.
    The manager reads it with ``getattr``: a tier written for an older vLLM returns
    that vLLM's JobResult, without it."""

    job_id: JobId
    success: bool
    successful_keys: Collection[OffloadKey] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None
    deferred_release: threading.Event | None = None


_OPTIONAL = ("tolerates_off_thread_polling", "polls_between_steps", "locality",
             "max_pinned_rows", "poll_fds", "defers_release", "idle_jobs",
             "step_needs_poll")


def optional_attribute(tier: Any, name: str) -> Any:
    """``tier``'s optional attribute ``name``, or the default declared on
    :class:`SecondaryTierManager` (a tier written for vLLM may lack it)."""
    assert name in _OPTIONAL, name
    return getattr(tier, name, getattr(SecondaryTierManager, name))


class ParentManager(ABC):
    """What a tier may call back during ``serve_external_requests`` (valid only
    during that call). Per remote request: ``on_new_request`` -> ``lookup`` /
    ``create_store_job`` (interleaved) -> ``on_request_finished`` (always)."""

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext: ...

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult: ...

    @abstractmethod
    def create_store_job(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TransferJob: ...

    @abstractmethod
    def on_request_finished(self, req_context: ReqContext) -> None: ...


_HIT_SOURCE = {Medium.CPU: CacheHitSource.HOST, Medium.STORAGE: CacheHitSource.DISK}


class SecondaryTierManager(ABC):
    """One tier below the primary. Subclasses set ``medium`` (which derives
    ``cache_hit_source``) and implement the abstract methods.

    ``lookup`` answers HIT (present now), MISS, or RETRY (not known yet: ask
    again next step). Every submitted job is reported exactly once by
    ``get_finished_jobs``. ``drain_jobs`` blocks until every submitted job has
    completed or failed, without aborting a copy in flight, and every
    ``JobResult.deferred_release`` it handed out is set (so it bounds how long a
    release can be deferred; past that it raises).
    """

    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    # Optional attributes: the manager reads each once, through ``optional_attribute``,
    # so a tier written for vLLM (whose base lacks some) gets these defaults.
    #: Poll this tier from the manager's tier-poll thread between steps too.
    tolerates_off_thread_polling: ClassVar[bool] = False
    #: Collect this tier's finished jobs from the manager's step-window thread while the
    #: engine runs its forward pass (``window_poll.py``), under the lock, never inside a
    #: step: for tiers whose ``get_finished_jobs`` is costly and not needed before the next
    #: step (results arrive throughout the forward pass). Each round first calls the
    #: tier's ``submit_between_steps()`` if it has one (then ``get_finished_jobs``): a tier
    #: may leave work that need not start within the step (stores) for it, as long as such
    #: rounds keep coming (it sees them come; none in a forward pass: send it in the step).
    polls_between_steps: ClassVar[bool] = False
    #: LOCAL or REMOTE, for ``kv_load_tiers`` request filters; None: unspecified.
    locality: Locality | None = None
    #: At most this many primary rows may wait for this tier's cascades; the keys of more
    #: cascades wait unpinned in the manager's bounded deferred queue (its overflow is
    #: dropped and counted as backpressure); None: no cap.
    max_pinned_rows: int | None = None
    #: With ``tolerates_off_thread_polling``: a method ``poll_fds() -> Sequence[int]``, the
    #: OS fds that become readable when the tier has news. The tier-poll thread calls it
    #: under the lock after each round and waits on them (without the lock, ``poll(2)``
    #: only) for at most ``tier_poll_interval_s``, so news wakes a round at once. The
    #: tier's first poll after the call must clear them (read them; for a ZeroMQ
    #: socket's ``FD``, edge-triggered, read ``EVENTS``) whatever throttle it applies; an
    #: fd left readable costs a round per interval (``poll_thread.py``). None: the
    #: thread polls every interval.
    poll_fds: Callable[[], Sequence[int]] | None = None
    #: Its failed promotions may carry ``JobResult.deferred_release``: the manager reports
    #: its deferred-release gauge every step (as it does for any tier once it deferred),
    #: and the tier declares ``metrics.deferred_release_metric_definitions()``.
    defers_release: ClassVar[bool] = False
    #: A method ``idle_jobs() -> int``: how many of this tier's submitted jobs need no
    #: engine step to finish (another process completes them; their results are taken by
    #: a later poll). ``has_pending_work`` does not keep an idle engine stepping for them
    #: (vLLM steps an engine with no request while it is True). None: every job does.
    idle_jobs: Callable[[], int] | None = None
    #: With ``polls_between_steps``: a method ``step_needs_poll() -> bool``, whether a
    #: step's own poll could collect something a step waits for (a load: its request is
    #: deferred until it is in). While the step-window thread's rounds come, a step polls
    #: the tier only then, and leaves the rest (cascades' results) to the next round.
    #: None: a step polls it whenever something may be in flight.
    step_needs_poll: Callable[[], bool] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "cache_hit_source" not in cls.__dict__ and cls.medium is not None:
            cls.cache_hit_source = _HIT_SOURCE[cls.medium]

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None) -> None:
        self._offloading_spec = offloading_spec
        self._primary_kv_view = primary_kv_view
        self._block_size_bytes: int = primary_kv_view.strides[0]
        self.tier_type = tier_type
        self._bp_detector = backpressure_detector

    @property
    def block_size_bytes(self) -> int:
        """Bytes of one padded primary row (what one chunk occupies)."""
        return self._block_size_bytes

    @property
    def bp_detector(self) -> Any:
        """The tier's backpressure detector (vLLM's name), or None."""
        return self._bp_detector

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult: ...

    @abstractmethod
    def submit_store(self, job: TransferJob) -> None: ...

    @abstractmethod
    def submit_load(self, job: TransferJob) -> None: ...

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]: ...

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext: ...

    @abstractmethod
    def drain_jobs(self) -> None: ...

    def has_pending_work(self) -> bool:
        return False

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return

    def on_request_finished(self, req_context: ReqContext) -> None:
        return

    def serve_external_requests(self, parent: ParentManager) -> None:
        return

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        return

    def shutdown(self) -> None:
        return

    @classmethod
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        return {}

    def get_stats(self) -> Any:
        return None

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ()

    def config_info(self) -> dict[str, Any]:
        return {}
