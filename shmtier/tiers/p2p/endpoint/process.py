"""The p2p tier's endpoint process: serves this engine's parked rows to peers, fetches theirs.

Runs in: the p2p endpoint process, one per engine, started (``python -m
shmtier.tiers.p2p.endpoint``, its settings as msgpack on stdin) and supervised by the
tier's scheduler half (``shmtier/tiers/p2p/supervisor.py``). It maps the engine's segment (``join_existing``) and reads and writes
arena rows directly; the scheduler thread never touches the network.

Threads: the main thread runs the ``ChunkServer`` and the PAIR socket to the scheduler
(``ipc://``, msgpack); one thread per peer runs that peer's ``ChunkClient`` (fetches and
lookups block up to their deadlines there, so a slow or stopped peer delays only its own
requests; the loads queued for a peer while it was busy go together, their fetches
pipelined on the one connection: ``ChunkClient.fetch_many``) and sends its answers,
packed, on an ``inproc://`` PUSH socket to the main thread, which forwards them
unchanged to the scheduler. The main thread's poll wakes for whichever socket has
something (peers, the scheduler, the peer threads): no hop waits for a tick.

Priority: the process lowers its own priority by the tier's ``endpoint_niceness`` (added
to the scheduler's niceness; default 10, as the tier workers) before it starts any thread,
so its transfers never preempt the latency-critical scheduler thread on a busy host.

Messages on the PAIR: ``shmtier/tiers/p2p/channel.py`` declares each one (a typed
message per kind; its docstring's table says what each means) and its encoding, and the
channel version this process announces in its first message, ``Ready``.

A promotion's fetch round asks again, every 20 ms, for keys the peer answered MISS (its
chunks may still be on their way into its CPU tier) until ``fetch_timeout_s``, or until
the peer answers a miss final (its request is complete: ``complete``); then it tells the
peer ``done`` with the keys it fetched (the peer unpins those; a later load of the same
request finds the rest still parked), or, if the load failed, ``done`` for the whole
request (the peer unpins all it parked for it).

Binding (``ChunkServer``'s ``request_owner``): a request parked with ``to`` is served only
to that peer: with CurveZMQ by its Curve public key (the handshake proves it; a ``to``
without a key is served to nobody), in plaintext by its hello name ("host:port"); the rows
parked for a peer's symmetric lookup are bound to the session that asked (its key). ``complete`` marks and bindings are forgotten ``complete_ttl_s`` after they were
set (the scheduler half's ``unbound_store_timeout_s``).

Checksums: each parked row's CRC-32C is computed once, by the main thread while it has
nothing else to do (``CHECKSUM_BATCH`` rows per loop round, between polls), or by the first
send of that row if a fetch comes first; the server sends it with the row instead of
reading the row again (``ChunkServer``'s provider may return ``(buffer, crc)``). In PD the
rows are parked while the consumer is still prefilling elsewhere, so the fetch finds the
checksums ready.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import signal
import sys
import threading
import time

import msgpack
import numpy as np
import zmq

from shmtier.shared.codec import crc32c
from shmtier.shared.jobs import Outcome
from shmtier.shared.log_setup import configure_logging
from shmtier.shared.redact import register_secrets_in
from shmtier.shared.segment import join_existing
from shmtier.tiers.p2p import channel
from shmtier.tiers.p2p.channel import LoadDone, LookupDone
from shmtier.tiers.p2p.endpoint.circuit import PeerCircuit
from shmtier.tiers.p2p.endpoint.client import ChunkClient
from shmtier.tiers.p2p.keys import AllowList, keypair_from_config
from shmtier.tiers.p2p.endpoint.server import ChunkServer, LookupToken
from shmtier.tiers.p2p.status import write_status

log = logging.getLogger(__name__)

TICK_S = 0.05  # the poll wakes at once for any socket; this paces the 1 s chores
COUNTERS_EVERY_S = 1.0
OWNER_CHECK_S = 1.0
MISS_RETRY_S = 0.02
DONE_TIMEOUT_S = 1.0
MAX_PIPELINED = 16  # tasks a peer thread takes from its queue at once (loads: one round)
CHECKSUM_BATCH = 2  # parked rows checksummed per loop round (~0.15 ms each for 1.4 MiB)
RESULTS = "inproc://p2p-endpoint-results"  # peer threads -> main thread (PUSH -> PULL)
# glibc mallopt (keep_receive_buffers): chunks up to 32 MiB (glibc's largest heap
# allocation) come from the heap; up to 64 MiB freed at the top of a heap is kept
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 64 << 20


class _Peer(threading.Thread):
    """One peer: its ChunkClient and its task queue, on its own thread."""

    def __init__(self, ep: "Endpoint", peer: str, server_key: str | None):
        super().__init__(name=f"p2p-peer-{peer}", daemon=True)
        host, _, port = peer.rpartition(":")
        self.ep = ep
        self.peer = peer
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._answered: set = set()  # jobs of the current batch answered already
        # this thread's end of RESULTS (a socket belongs to the thread that uses it)
        self.out = ep.ctx.socket(zmq.PUSH)
        self.out.linger = 0
        self.out.sndhwm = 0
        self.out.connect(RESULTS)
        self.client = ChunkClient(
            host, int(port), fingerprint=ep.fingerprint, hash_seed=ep.hash_seed,
            keys=ep.keys, server_key=server_key, plaintext=ep.plaintext, name=ep.name,
            circuit=PeerCircuit(0.5, 30.0), context=ep.ctx)

    def run(self) -> None:
        try:
            while True:
                tasks = [self.tasks.get()]
                while len(tasks) < MAX_PIPELINED:  # what queued meanwhile goes together
                    try:
                        tasks.append(self.tasks.get_nowait())
                    except queue.Empty:
                        break
                loads = [t for t in tasks if type(t) is channel.Load]
                if loads:
                    self._guarded(lambda: self._loads(loads), loads)
                for task in tasks:
                    if task is None:
                        return
                    if type(task) is channel.Lookup:
                        self._guarded(lambda: self._lookup(task), [task])
                    elif type(task) is channel.Release:
                        self._guarded(lambda: self._release(task), [task])
        finally:
            self.client.close()
            self.out.close(0)

    def _guarded(self, fn, tasks: list) -> None:
        """Run ``fn()`` for ``tasks``; what it returns goes to the main thread; an
        exception answers every one of ``tasks`` not answered yet as failed."""
        try:
            out = fn()
            if out is not None:
                self.out.send(channel.encode((out,)))  # no HWM: never blocks
        except Exception as e:  # never lose a job: answer it failed
            log.exception("p2p endpoint: %s for peer %s raised", type(tasks[0]).__name__,
                          self.peer)
            for task in tasks:
                if type(task) is not channel.Load or task.job not in self._answered:
                    out = _failed(task, f"{type(e).__name__}: {e}")
                    if out is not None:
                        self.out.send(channel.encode((out,)))
        self._answered.clear()

    def _loads(self, tasks: list[channel.Load]) -> None:
        """Fetch rounds for several loads at once: each round pipelines one fetch per
        load still fetching (``ChunkClient.fetch_many``); keys answered MISS (not final)
        are asked again every ``MISS_RETRY_S`` until ``fetch_timeout_s``. Each load is
        answered (``load_done``) and its chunks released at the peer (``done``) as soon
        as it is finished, not when the others are."""
        t0 = time.monotonic()
        deadline = t0 + self.ep.fetch_timeout_s
        state = [{"task": t, "ok": [False] * len(t.keys), "nbytes": 0, "detail": "",
                  "todo": list(range(len(t.keys)))} for t in tasks]
        while state:
            left = deadline - time.monotonic()
            if left <= 0:
                for st in state:
                    st["detail"] = (f"timeout: {len(st['todo'])} chunks not offered by "
                                    f"{self.peer} within {self.ep.fetch_timeout_s:g} s")
                    self._load_done(st, t0)
                return
            results = self.client.fetch_many(
                [([st["task"].keys[i] for i in st["todo"]],
                  [self.ep.row(st["task"].rows[i]) for i in st["todo"]], st["task"].req)
                 for st in state], left)
            waiting = []
            for st, res in zip(state, results):
                missing, final = [], 0
                for j, i in enumerate(st["todo"]):
                    outcome = res.outcomes[j]
                    if outcome == Outcome.OK:
                        st["ok"][i] = True
                        st["nbytes"] += res.nbytes[j]
                    elif outcome == Outcome.MISS and res.final[j]:
                        final += 1
                    elif outcome == Outcome.MISS:
                        missing.append(i)
                    elif not st["detail"]:
                        st["detail"] = f"{outcome.name.lower()}: {res.details[j]}"
                if final and not st["detail"]:
                    st["detail"] = (f"miss: {final} chunks never stored by {self.peer} (its "
                                    f"request {st['task'].req} is complete)")
                st["todo"] = missing
                if st["detail"] or not missing:
                    self._load_done(st, t0)
                else:
                    waiting.append(st)
            state = waiting
            if state:
                time.sleep(min(MISS_RETRY_S, max(0.0, deadline - time.monotonic())))

    def _load_done(self, st: dict, t0: float) -> None:
        task = st["task"]
        # A load that got every chunk releases just those at the peer: the same request's
        # other keys may come in a later load (the manager promotes a request's keys in
        # as many jobs as it has rows for). A failed load releases the whole request (it
        # fails at the scheduler: its later lookups MISS).
        fetched = None if st["detail"] else list(task.keys)
        self.client.done(task.req, DONE_TIMEOUT_S, fetched)
        self.out.send(channel.encode((LoadDone(
            task.job, [i for i, o in enumerate(st["ok"]) if o], st["nbytes"],
            time.monotonic() - t0, st["detail"]),)))
        self._answered.add(task.job)

    def _lookup(self, task: channel.Lookup) -> LookupDone:
        hits = self.client.lookup(task.keys, self.ep.lookup_timeout_s, task.req)
        return LookupDone(task.lid, hits, self.client.last_error)

    def _release(self, task: channel.Release) -> None:
        self.client.done(task.req, DONE_TIMEOUT_S)
        return None


def _failed(task, detail: str) -> LoadDone | LookupDone | None:
    """The answer of ``task`` (a load or lookup) that failed with ``detail``."""
    if type(task) is channel.Load:
        return LoadDone(task.job, [], 0, 0.0, detail)
    if type(task) is channel.Lookup:
        return LookupDone(task.lid, None, detail)
    return None


class Endpoint:
    """The endpoint of one engine (see the module docstring). ``settings``: what the
    scheduler half wrote on stdin (``P2PTierManager._settings``)."""

    def __init__(self, settings: dict):
        self.settings = settings
        self.name = settings["name"]
        self.fingerprint = settings["fingerprint"]
        self.hash_seed = settings["hash_seed"]
        self.plaintext = settings["plaintext"]
        self.fetch_timeout_s = settings["fetch_timeout_s"]
        self.lookup_timeout_s = settings["lookup_timeout_s"]
        self.keys = None if self.plaintext else keypair_from_config(settings["secret"])
        allow = None if self.plaintext else AllowList(settings["allow"], settings["allow_source"])
        self.segment = join_existing(settings["engine_id"])
        g = self.segment.geometry
        self.payload = g.page_size_per_worker * g.world_size
        self.arena = np.frombuffer(self.segment.arena, np.uint8).reshape(g.num_chunks,
                                                                         g.row_stride)
        self.ctx = zmq.Context()
        self.pair = self.ctx.socket(zmq.PAIR)
        self.pair.linger = 0
        self.pair.sndhwm = self.pair.rcvhwm = 0
        self.pair.connect(settings["ipc"])
        self.results = self.ctx.socket(zmq.PULL)  # the peer threads' answers, packed
        self.results.linger = 0
        self.results.rcvhwm = 0
        self.results.bind(RESULTS)
        self.complete_ttl_s = float(settings.get("complete_ttl_s", 60.0))
        # req -> key -> [row, CRC-32C of the row's payload or None (not computed yet)]
        self.parked: dict[str, dict[bytes, list]] = {}
        self.unsummed: collections.deque = collections.deque()  # parked entries without a CRC
        self.complete: dict[str, float] = {}  # req -> forget at (monotonic)
        self.owners: dict[str, tuple[str, str, float]] = {}  # req -> (name, key, forget at)
        self.peers: dict[str, _Peer] = {}
        self.tokens: dict[int, LookupToken] = {}
        self._tids = itertools.count(1)
        self.stopping = False
        self.server = ChunkServer(
            settings["host"], settings["port"], provider=lambda key: None,
            request_provider=self._provide, lookup_handler=self._ext_lookup,
            on_done=self._done, request_complete=self.complete.__contains__,
            request_owner=self._owner, fingerprint=self.fingerprint,
            hash_seed=self.hash_seed, keys=self.keys, allow=allow, plaintext=self.plaintext,
            name=self.name)
        self.server.watch(self.pair)
        self.server.watch(self.results)
        # with port 0 the bound port is known now: peers see this name (their metrics' label)
        self.name = f"{settings['host']}:{self.server.port}"
        self.status_path = settings.get("status")  # status.json for the CLI (status.py)
        self._status_failed = False

    def row(self, row: int) -> memoryview:
        return memoryview(self.arena[row, :self.payload])

    # ---- the server's callbacks (main thread)

    def _provide(self, req: str, key: bytes):
        entry = self.parked.get(req, {}).get(key)
        if entry is None:
            return None
        if entry[1] is None:  # asked before the idle loop got to it
            entry[1] = crc32c(self.row(entry[0]))
        return self.row(entry[0]), entry[1]

    def _park(self, req: str, keys: list, rows: list) -> None:
        """Serve ``rows`` for ``req``; their checksums are computed by :meth:`_checksum`
        when the loop is idle (or by the first send), once per parked row."""
        entries = [[row, None] for row in rows]
        self.parked.setdefault(req, {}).update(zip(keys, entries))
        self.unsummed.extend(entries)

    def _checksum(self, budget: int) -> bool:
        """Compute the CRC-32C of up to ``budget`` parked rows that have none (rows
        released meanwhile included: harmless); True when some are left. Parked rows are
        pinned by the scheduler half and not written until released, so the checksum
        taken now is the one the client checks (a row changed since fails it)."""
        while self.unsummed and budget:
            entry = self.unsummed.popleft()
            if entry[1] is None:
                entry[1] = crc32c(self.row(entry[0]))
                budget -= 1
        return bool(self.unsummed)

    def _ext_lookup(self, token: LookupToken, req: str, keys: list) -> None:
        tid = next(self._tids)
        self.tokens[tid] = token
        self._send(channel.ExtLookup(tid, req, token.name, keys))

    def _unpark(self, req: str) -> None:
        for entry in self.parked.pop(req, {}).values():
            if entry[1] is None:
                entry[1] = -1  # no longer served: the idle loop skips it

    def _done(self, req: str, keys: list | None = None) -> None:
        """A peer is done with ``req`` (``keys`` None: all of it), or with ``keys`` of it:
        those are served no more, the rest of the request stays parked."""
        if keys is None:
            self._unpark(req)
            self._send(channel.Released(req))
            return
        parked = self.parked.get(req, {})
        for key in keys:
            entry = parked.pop(key, None)
            if entry is not None and entry[1] is None:
                entry[1] = -1
        if not parked:
            self.parked.pop(req, None)
        self._send(channel.Released(req, keys))

    def _owner(self, req: str) -> tuple[str, str] | None:
        owner = self.owners.get(req)
        return None if owner is None else owner[:2]

    def _bind(self, req: str, name: str, key: str) -> None:
        """Serve ``req`` only to the peer with Curve key ``key`` (authenticated by the
        handshake); in plaintext to the one whose hello names it ``name``. With CurveZMQ
        and no key it is served to nobody: a hello's name is the client's claim (the
        scheduler half does not park such a request; this holds if it ever did)."""
        if not key and not self.plaintext:
            log.error("p2p endpoint %s: request %s bound to %r without its key: served to "
                      "no peer", self.name, req, name)
            name = key = "\0"
        self.owners[req] = ("" if key else name, key, time.monotonic() + self.complete_ttl_s)

    def _forget_old(self, now: float) -> None:
        for req in [r for r, t in self.complete.items() if now > t]:
            del self.complete[req]
        for req in [r for r, o in self.owners.items() if now > o[2] and r not in self.parked]:
            del self.owners[req]

    # ---- the scheduler's messages

    def _send(self, msg: channel.ToScheduler) -> None:
        self.pair.send(channel.encode((msg,)))  # no HWM: never blocks

    def _handle(self, msg: channel.ToEndpoint) -> None:
        kind = type(msg)
        if kind is channel.Park:
            self._park(msg.req, msg.keys, msg.rows)
            if msg.to:
                self._bind(msg.req, *msg.to)
        elif kind is channel.Complete:
            self.complete[msg.req] = time.monotonic() + self.complete_ttl_s
        elif kind is channel.Unpark:
            self._unpark(msg.req)
        elif kind is channel.Load or kind is channel.Lookup or kind is channel.Release:
            self._peer(msg.peer, msg.skey).tasks.put(msg)
        elif kind is channel.Answer:
            if msg.keys:
                self._park(msg.req, msg.keys, msg.rows)
            token = self.tokens.pop(msg.tid, None)
            if token is not None:
                if msg.keys and msg.req not in self.owners:
                    self._bind(msg.req, token.name, token.key)  # the peer that asked
                self.server.answer_lookup(token, msg.hits)
        elif kind is channel.Stop:
            self.stopping = True

    def _peer(self, peer: str, server_key: str | None) -> _Peer:
        worker = self.peers.get(peer)
        if worker is None:
            worker = self.peers[peer] = _Peer(self, peer, server_key)
            worker.start()
        return worker

    def counters(self) -> channel.Counters:
        return channel.Counters(
            self.server.counters.as_dict(), dict(self.server.peer_bytes),
            {p: w.client.counters.as_dict() for p, w in self.peers.items()})

    def status(self, counters: channel.Counters) -> dict:
        """What ``status.p2p_sessions`` shows for this engine (read by the CLI)."""
        outbound = []
        for peer, w in list(self.peers.items()):
            c, circuit = counters.clients.get(peer, {}), w.client.circuit
            outbound.append({
                "peer": peer, "circuit": circuit.state, "failures": circuit.failures,
                "retry_in_s": round(circuit.retry_in(), 3), "last_error": w.client.last_error,
                "refused": sum(c.get("refused_handshakes", {}).values()),
                **{k: c.get(k, 0) for k in ("requests", "lookups", "chunks", "bytes_received",
                                            "timeouts", "errors")}})
        return {"engine_id": self.settings["engine_id"], "endpoint": self.name,
                "pid": os.getpid(), "plaintext": self.plaintext, "updated": time.time(),
                "parked": {"requests": len(self.parked),
                           "rows": sum(len(rows) for rows in self.parked.values())},
                "inbound": self.server.sessions(), "outbound": outbound,
                "server": counters.server}

    def _report(self) -> None:
        try:
            counters = self.counters()
        except RuntimeError:  # a peer thread changed a dict being copied: next second
            return
        self._send(counters)
        if self.status_path:
            try:
                write_status(self.status_path, self.status(counters))
            except (OSError, RuntimeError) as e:
                if not self._status_failed:
                    self._status_failed = True
                    log.warning("p2p endpoint %s: cannot write its status file %s: %s",
                                self.name, self.status_path, e)

    # ---- loop

    def run(self) -> int:
        self._send(channel.Ready(channel.VERSION, self.server.port))
        next_counters = next_owner = time.monotonic()
        busy = False  # parked rows still without a checksum: do not wait in poll
        while not self.stopping:
            self.server.poll(0 if busy else TICK_S)
            while True:
                try:
                    buf = self.pair.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for msg in channel.from_scheduler(buf):  # a step's batch
                    self._handle(msg)
            while True:
                try:
                    self.pair.send(self.results.recv(zmq.NOBLOCK))  # packed by the peer
                except zmq.Again:
                    break
            busy = self._checksum(CHECKSUM_BATCH)
            now = time.monotonic()
            if now >= next_counters:
                next_counters = now + COUNTERS_EVERY_S
                self._report()
                self._forget_old(now)
            if now >= next_owner:
                next_owner = now + OWNER_CHECK_S
                if not self.segment.header().owner_alive():
                    log.warning("p2p endpoint %s: the engine is gone; exiting", self.name)
                    return 3
        return 0

    def close(self) -> None:
        for worker in self.peers.values():
            worker.tasks.put(None)
        for worker in self.peers.values():
            worker.join(2.0)
        self.server.close()
        self.pair.close(0)
        self.results.close(0)
        if not any(w.is_alive() for w in self.peers.values()):
            self.ctx.term()  # (a peer thread stuck in a fetch: the exit ends it)
        self.arena = None
        self.parked.clear()
        self.unsummed.clear()
        try:
            self.segment.close()
        except BufferError:  # a row still referenced by a send in flight: the exit unmaps it
            pass


def keep_receive_buffers() -> bool:
    """Make glibc keep freed chunk-sized buffers for reuse in this process instead of
    handing their pages back to the kernel: every chunk a peer sends arrives in a buffer
    libzmq's I/O thread mallocs (its size) and the peer thread frees after copying it into
    the row. When the peer thread falls a few chunks behind, the freed buffers pile up at
    the top of the I/O thread's heap past glibc's trim threshold (twice the largest chunk
    freed so far), the heap is trimmed (``madvise``) and the next buffers page-fault in
    again: a third of the I/O thread's time in the profile (bench/README.md, p2p_tier.py
    section). Sets ``M_MMAP_THRESHOLD`` to ``MMAP_THRESHOLD_BYTES`` (setting a threshold
    turns glibc's own adjustment off, so both are set) and ``M_TRIM_THRESHOLD`` to
    ``TRIM_THRESHOLD_BYTES``: at most that much freed memory is kept at the top of each
    heap. Call once, before any thread starts. False (nothing changed) where the C library
    has no ``mallopt`` (not glibc) or refuses the values."""
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def main() -> int:
    configure_logging("p2p-endpoint")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    settings = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
    register_secrets_in(settings)  # its CurveZMQ secret key never reaches a log line
    # background work: below the scheduler, before any thread (they inherit it)
    os.nice(int(settings.get("niceness", 0)))
    if not keep_receive_buffers():
        log.info("p2p endpoint: mallopt not available; received chunks may page-fault")
    try:
        endpoint = Endpoint(settings)
    except OSError as e:  # cannot bind: the scheduler half restarts us with backoff
        log.error("p2p endpoint cannot start: %s", e)
        return 2
    code = 1
    try:
        code = endpoint.run()
        return code
    finally:
        endpoint.close()
        if code == 3:  # the engine died without shutting us down: remove its socket dir
            _remove_socket_dir(settings["ipc"])


def _remove_socket_dir(ipc: str) -> None:
    import shutil

    from shmtier.tiers.p2p.socket_dirs import DIR_PREFIX
    directory = os.path.dirname(ipc[len("ipc://"):])
    if os.path.basename(directory).startswith(DIR_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
