"""The p2p tier's transport: a ChunkServer that serves arena rows, a ChunkClient that fetches them.

Runs in: tier worker processes only. Both classes do network I/O; the scheduler process
never calls them (it must never block on the network). Built on pyzmq (ROUTER/DEALER over
TCP, CurveZMQ, a ZAP handler), control messages in msgpack (``wire.py``), chunk bytes as
raw ZeroMQ frames with shmtier's CRC-32C (``shmtier.shared.codec.crc32c``). Imports neither
torch nor vLLM.

Message flow (one client, one server; each engine runs a server and a client per peer)::

    ChunkClient (DEALER, Curve client)                  ChunkServer (ROUTER, Curve server)
    ──────────────────────────────────                  ─────────────────────────────────────
    connect tcp://host:port ──── CurveZMQ handshake ───▶ ZAP handler (same poll loop):
                                                          client key in the AllowList? else
    ◀── refused at handshake (monitor: AUTH 400) ◀───── 400, counted "unknown_key"
    {t:hello, v, fp, seed, name} ──────────────────────▶ same version, fingerprint, seed?
    ◀────────────────── {t:hello_ok} | {t:refused, reason} (counted, session serves nothing)
    {t:lookup, rid, keys} ─────────────────────────────▶ has(key) for each key
    ◀──────────────────────────── {t:lookup_resp, rid, hits}
    {t:fetch, rid, keys} ──────────────────────────────▶ per key, in order, as the peer's
                                                          send queue has room:
                                                          view = provider(key); crc = crc32c(view)
    recv_into(dest row) ◀── [{t:chunk, rid, i, key, st:ok, n, crc}, view (zero-copy frame)]
    crc32c(dest row) == crc ? OK : CORRUPT
                        ◀── [{t:chunk, rid, i, key, st:miss}]  -> MISS

A client call has one deadline: connecting, the hello and the answers all fit in its
``timeout_s``; what is not answered by then is ERROR, the socket is dropped (late answers
are never read into a row) and the peer's :class:`PeerCircuit` opens: later calls fail at
once until its backoff expires. A peer that drops the connection (killed) fails the call
as soon as the client's socket monitor says so; one restarted between calls is met with a
new connection and hello by the next call (or, if its restart went unseen, its ``no_hello``
answer makes the client say hello once more within the same deadline). The server never
blocks on one peer: its
sends are non-blocking and a peer whose queue is full waits in its own outbox
(``stall_timeout_s``, then dropped) while the others are served.

Row memory: the server sends the provider's memoryview without copying it (libzmq sends
from it later, in its I/O thread); the bytes must not change until sent, or the client's
CRC check fails (CORRUPT: never wrong bytes, but a wasted fetch). The client receives each
chunk's frame straight into its destination view (``Socket.recv_into``: one copy, from
libzmq's receive buffer). A destination whose outcome is not OK holds undefined bytes.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from shmtier.shared.codec import crc32c
from shmtier.shared.jobs import Outcome
from shmtier.tiers.p2p import wire
from shmtier.tiers.p2p.circuit import PeerCircuit
from shmtier.tiers.p2p.counters import TransportCounters
from shmtier.tiers.p2p.keys import AllowList, CurveKeyPair, parse_key

__all__ = ["ChunkClient", "ChunkServer", "FetchResult", "Provider"]

log = logging.getLogger(__name__)

Provider = Callable[[bytes], Any]  # key -> a buffer of the chunk's bytes, or None

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"shmtier-p2p"
SEND_HWM = 256             # messages queued in libzmq per peer before the server's outbox
RECV_HWM = 64              # chunk messages a client buffers (~90 MiB of 1.4 MiB chunks)
FLUSH_BUDGET = 16          # chunks sent per peer per poll round (fairness between peers)
BLOCKED_RETRY_S = 0.002    # how often a server retries a peer whose send queue was full
MAX_SESSIONS = 1024        # hello sessions the server remembers (oldest dropped)
_RECV_BATCH = 64           # inbound messages a server handles per poll round

_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "handshake_crypto",
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "handshake_mechanism",
}


def _plaintext_warning(role: str, endpoint: str) -> None:
    log.warning("p2p %s %s runs in PLAINTEXT mode (plaintext=True): peers are not "
                "authenticated and chunk bytes cross the network unencrypted; use it only "
                "on a trusted network", role, endpoint)


def _byte_view(buf: Any, *, writable: bool, what: str) -> memoryview:
    mv = memoryview(buf)
    if writable and mv.readonly:
        raise ValueError(f"{what} is read-only")
    if mv.format != "B" or mv.ndim != 1:
        if not mv.c_contiguous:
            raise ValueError(f"{what} is not contiguous")
        mv = mv.cast("B")
    elif not mv.contiguous:
        raise ValueError(f"{what} is not contiguous")
    return mv


# --------------------------------------------------------------------------- server


@dataclass
class _Session:
    """One connected peer as the server knows it, by its ROUTER routing id."""

    user_id: str            # its Curve public key (Z85) from the ZAP reply; "" plaintext
    name: str = ""
    refused: str = ""       # the reason its hello was refused ("" admitted)


@dataclass
class _Item:
    """One message for a peer, in its outbox: ready frames, or a chunk still to read."""

    rid: int
    frames: list | None = None
    index: int = 0
    key: bytes = b""


@dataclass
class _Outbox:
    items: collections.deque = field(default_factory=collections.deque)
    blocked_since: float | None = None


class ChunkServer:
    """Serves the chunks of one engine to its admitted peers.

    Who calls: the tier worker that serves peers (one per engine and data-parallel rank),
    on one thread: construct it, then call :meth:`poll` in its loop (or :meth:`serve`),
    :meth:`close` at the end. Not thread-safe.

    ``host``, ``port``: where the ROUTER socket binds (``port=0``: a free port, read back
    from :attr:`port`). ``provider(key)``: the chunk's bytes (a buffer: a memoryview of an
    arena row, a numpy row) or None (MISS); it is called when the chunk is about to be
    sent; an exception becomes an ``"error"`` answer for that key. ``has(key)``: answers
    lookups (default: ``provider(key) is not None``). ``fingerprint`` and ``hash_seed``:
    the engine's layout fingerprint and hash seed; a hello with other values is refused
    and counted, and that peer is served nothing.

    Security: ``keys`` (this server's :class:`CurveKeyPair`, with its secret) and ``allow``
    (the :class:`AllowList` of client public keys) are required unless ``plaintext=True``,
    which must be asked for explicitly, takes neither, and logs a WARNING. A client key not
    in the allow-list is refused by the ZAP handler during the Curve handshake (counted
    ``unknown_key``; its connection never delivers a message).

    ``stall_timeout_s``: a peer whose send queue stays full this long (a stalled or
    stopped client) has its queued answers dropped (counted as a timeout). ``tamper``:
    test hook, ``tamper(key, view) -> buffer`` called after the checksum is computed; its
    result is sent instead of the row.

    Construction binds the socket (raises OSError when it cannot, e.g. address in use)
    and never blocks on the network.
    """

    def __init__(self, host: str, port: int, *, provider: Provider, fingerprint: str,
                 hash_seed: Any, keys: CurveKeyPair | None = None,
                 allow: AllowList | None = None, plaintext: bool = False,
                 has: Callable[[bytes], bool] | None = None, name: str = "",
                 stall_timeout_s: float = 30.0,
                 tamper: Callable[[bytes, memoryview], Any] | None = None):
        if plaintext:
            if keys is not None or allow is not None:
                raise ValueError("ChunkServer: plaintext=True takes no keys and no allow-list "
                                 "(choose one: CurveZMQ or plaintext)")
        else:
            if keys is None or keys.secret is None:
                raise ValueError("ChunkServer: needs keys= (this server's key pair, with its "
                                 "secret key) unless plaintext=True")
            if not isinstance(allow, AllowList):
                raise ValueError("ChunkServer: needs allow= (an AllowList of client public "
                                 "keys) unless plaintext=True")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"ChunkServer: fingerprint must be a non-empty string, got "
                             f"{fingerprint!r}")
        self.name = name or f"{host}:{port}"
        self.plaintext = plaintext
        self.counters = TransportCounters()
        self._provider = provider
        self._has = has
        self._fingerprint = fingerprint
        self._hash_seed = hash_seed
        self._allow = allow
        self._stall_timeout_s = stall_timeout_s
        self._tamper = tamper
        self._sessions: collections.OrderedDict[bytes, _Session] = collections.OrderedDict()
        self._out: dict[bytes, _Outbox] = {}
        self._logged: set = set()
        self._closed = False
        self._ctx = zmq.Context()
        self._zap = self._mon = self._sock = None
        try:
            sock = self._sock = self._ctx.socket(zmq.ROUTER)
            sock.linger = 0
            sock.router_mandatory = 1
            sock.sndhwm = SEND_HWM
            sock.maxmsgsize = wire.MAX_CONTROL_BYTES
            if not plaintext:
                self._zap = self._ctx.socket(zmq.REP)
                self._zap.linger = 0
                self._zap.bind(ZAP_ENDPOINT)
                sock.curve_server = True
                sock.curve_secretkey = keys.secret
                sock.curve_publickey = keys.public
                sock.zap_domain = ZAP_DOMAIN
            self._mon = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
            try:
                if port == 0:
                    self.port = sock.bind_to_random_port(f"tcp://{host}")
                else:
                    sock.bind(f"tcp://{host}:{port}")
                    self.port = port
            except zmq.ZMQError as e:
                raise OSError(e.errno, f"p2p server cannot bind tcp://{host}:{port}: "
                                       f"{e.strerror}") from None
        except BaseException:
            self.close()
            raise
        self.host = host
        self.endpoint = f"tcp://{host}:{self.port}"
        self._poller = zmq.Poller()
        for s in (self._sock, self._mon, self._zap):
            if s is not None:
                self._poller.register(s, zmq.POLLIN)
        if plaintext:
            _plaintext_warning("server", self.endpoint)
        else:
            log.info("p2p server %s listening (CurveZMQ, %d allowed keys from %s)",
                     self.endpoint, len(allow), allow.source)

    # ------------------------------------------------------------------ loop

    def poll(self, timeout_s: float = 0.0) -> int:
        """Handle what has arrived (handshakes, hellos, requests) and send what the peers'
        queues have room for. Blocks at most ``timeout_s`` waiting for something to
        arrive (not at all while answers are ready to go; at most a few milliseconds while
        a peer's queue is full), plus the time to read and checksum the chunks it sends
        (at most ``FLUSH_BUDGET`` per peer). Returns the number of messages handled and
        sent (0: nothing happened)."""
        if self._closed:
            raise RuntimeError("ChunkServer.poll after close")
        if any(box.blocked_since is None for box in self._out.values()):
            wait_ms = 0
        else:
            wait_s = min(timeout_s, BLOCKED_RETRY_S) if self._out else timeout_s
            wait_ms = max(0, math.ceil(wait_s * 1000))
        events = dict(self._poller.poll(wait_ms))
        done = 0
        if self._zap is not None and self._zap in events:
            done += self._answer_zap()
        if self._mon in events:
            self._read_monitor()
        if self._sock in events:
            done += self._read_requests()
        if self._out:
            done += self._flush()
        return done

    def serve(self, should_stop: Callable[[], bool], tick_s: float = 0.1) -> None:
        """Run :meth:`poll` until ``should_stop()`` is true (checked every ``tick_s`` at
        least). Blocks the calling thread for that long."""
        while not should_stop():
            self.poll(tick_s)

    def close(self) -> None:
        """Close the sockets (queued answers are dropped) and the context. Idempotent."""
        self._closed = True
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
        for s in (self._mon, self._zap, self._sock):
            if s is not None:
                s.close(linger=0)
        self._mon = self._zap = self._sock = None
        self._out.clear()
        self._ctx.term()

    def __enter__(self) -> "ChunkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ handshake

    def _answer_zap(self) -> int:
        """Answer ZAP requests: admit a CURVE client whose public key is allowed."""
        n = 0
        while True:
            try:
                frames = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            version, request_id = frames[0], frames[1] if len(frames) > 1 else b""
            mechanism = frames[5] if len(frames) > 5 else b""
            address = frames[3].decode(errors="replace") if len(frames) > 3 else "?"
            creds = frames[6:]
            if (version == b"1.0" and mechanism == b"CURVE" and len(creds) == 1
                    and creds[0] in self._allow):
                reply = [b"1.0", request_id, b"200", b"OK", z85.encode(creds[0]), b""]
            else:
                self.counters.refuse("unknown_key")
                who = z85.encode(creds[0]).decode() if len(creds) == 1 and len(creds[0]) == 32 \
                    else mechanism.decode(errors="replace")
                if ("zap", who) not in self._logged:
                    self._logged.add(("zap", who))
                    log.warning("p2p server %s refused a client from %s at the handshake: "
                                "public key %s is not in the allow-list (%s)", self.endpoint,
                                address, who, self._allow.source)
                reply = [b"1.0", request_id, b"400", b"public key not allowed", b"", b""]
            self._zap.send_multipart(reply)

    def _read_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # the ZAP handler counted it
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                reason = _PROTOCOL_REASONS.get(event["value"], "handshake_protocol")
            else:
                reason = "handshake"
            self.counters.refuse(reason)
            if reason not in self._logged:
                self._logged.add(reason)
                log.warning("p2p server %s: a client's CurveZMQ handshake failed (%s: the "
                            "client expects another server public key, or does not speak "
                            "the same mechanism); further ones are only counted",
                            self.endpoint, reason)

    # ------------------------------------------------------------------ requests

    def _read_requests(self) -> int:
        n = 0
        while n < _RECV_BATCH:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            n += 1
            peer = frames[0].bytes
            if len(frames) != 2:
                self._reply_error(peer, 0, "malformed", f"{len(frames) - 1} frames, expected 1")
                continue
            try:
                msg = wire.unpack(frames[1].buffer)
            except wire.ProtocolError as e:
                self._reply_error(peer, 0, e.reason, e.detail)
                continue
            try:
                self._handle(peer, frames[1], msg)
            except wire.ProtocolError as e:
                self._reply_error(peer, msg.get("rid", 0) if isinstance(msg.get("rid"), int)
                                  else 0, e.reason, e.detail)
        return n

    def _handle(self, peer: bytes, frame: zmq.Frame, msg: dict) -> None:
        t = msg["t"]
        if t == "hello":
            self._hello(peer, frame, msg)
            return
        rid = wire.check_rid(msg)
        session = self._sessions.get(peer)
        if session is None:
            self.counters.refuse("no_hello")
            self._queue(peer, rid, {"t": "refused", "rid": rid, "reason": "no_hello",
                                    "detail": "send a hello first"})
            return
        self._sessions.move_to_end(peer)
        if session.refused:
            self._queue(peer, rid, {"t": "refused", "rid": rid, "reason": session.refused,
                                    "detail": "this session's hello was refused"})
            return
        if t == "fetch":
            keys = wire.check_keys(msg)
            self.counters.requests += 1
            box = self._out.setdefault(peer, _Outbox())
            box.items.extend(_Item(rid, None, i, k) for i, k in enumerate(keys))
        elif t == "lookup":
            keys = wire.check_keys(msg)
            self.counters.lookups += 1
            self._queue(peer, rid, {"t": "lookup_resp", "rid": rid,
                                    "hits": [self._lookup(k) for k in keys]})
        else:
            raise wire.ProtocolError("malformed", f"unknown message type {t!r}")

    def _hello(self, peer: bytes, frame: zmq.Frame, msg: dict) -> None:
        try:
            user_id = frame.get("User-Id") or ""
        except zmq.ZMQError:
            user_id = ""
        name = str(msg.get("name", ""))[:200]
        if msg.get("v") != wire.PROTOCOL_VERSION:
            reason, detail = "version", (f"protocol version {msg.get('v')!r}, this server "
                                         f"speaks {wire.PROTOCOL_VERSION}")
        elif msg.get("fp") != self._fingerprint:
            reason, detail = "fingerprint", (f"layout fingerprint {msg.get('fp')!r} differs "
                                             f"from this engine's {self._fingerprint!r}")
        elif msg.get("seed") != self._hash_seed:
            reason, detail = "hash_seed", "hash seed differs from this engine's"
        else:
            reason, detail = "", ""
        self._sessions[peer] = _Session(user_id, name, reason)
        self._sessions.move_to_end(peer)
        while len(self._sessions) > MAX_SESSIONS:
            old, _ = self._sessions.popitem(last=False)
            self._out.pop(old, None)
        if reason:
            self.counters.refuse(reason)
            if (reason, user_id) not in self._logged:
                self._logged.add((reason, user_id))
                log.warning("p2p server %s refused peer %r (key %s): %s", self.endpoint, name,
                            user_id or "-", detail)
            self._queue(peer, 0, {"t": "refused", "rid": 0, "reason": reason, "detail": detail})
        else:
            self.counters.handshakes += 1
            self._queue(peer, 0, {"t": "hello_ok", "v": wire.PROTOCOL_VERSION,
                                  "name": self.name})

    def _lookup(self, key: bytes) -> bool:
        try:
            if self._has is not None:
                return bool(self._has(key))
            return self._provider(key) is not None
        except Exception as e:  # a provider bug answers "not here", never kills the loop
            self.counters.errors += 1
            log.error("p2p server %s: lookup of key %s raised %s: %s", self.endpoint,
                      key.hex(), type(e).__name__, e)
            return False

    def _reply_error(self, peer: bytes, rid: int, reason: str, detail: str) -> None:
        self.counters.errors += 1
        self._queue(peer, rid, {"t": "error", "rid": rid, "reason": reason, "detail": detail})

    def _queue(self, peer: bytes, rid: int, msg: dict) -> None:
        box = self._out.setdefault(peer, _Outbox())
        box.items.append(_Item(rid, [wire.pack(msg)]))

    # ------------------------------------------------------------------ sending

    def _chunk_frames(self, item: _Item) -> list:
        """The header (and data) frames of one chunk answer: reads the row now."""
        key = item.key
        head = {"t": "chunk", "rid": item.rid, "i": item.index, "key": key}
        try:
            buf = self._provider(key)
            view = None if buf is None else _byte_view(buf, writable=False, what="provided row")
        except Exception as e:
            self.counters.errors += 1
            log.error("p2p server %s: provider raised for key %s: %s: %s", self.endpoint,
                      key.hex(), type(e).__name__, e)
            head.update(st="error", why=f"{type(e).__name__}: {e}"[:200])
            return [wire.pack(head)]
        if view is None:
            self.counters.misses += 1
            head["st"] = "miss"
            return [wire.pack(head)]
        head.update(st="ok", n=view.nbytes, crc=crc32c(view))
        if self._tamper is not None:
            view = self._tamper(key, view)
        self.counters.chunks += 1
        self.counters.bytes_sent += head["n"]
        return [wire.pack(head), view]

    def _flush(self) -> int:
        sent = 0
        now = time.monotonic()
        for peer in list(self._out):
            box = self._out[peer]
            budget = FLUSH_BUDGET
            while box.items and budget:
                item = box.items[0]
                if item.frames is None:
                    item.frames = self._chunk_frames(item)
                try:
                    self._sock.send(peer, zmq.SNDMORE | zmq.NOBLOCK)
                except zmq.Again:
                    if box.blocked_since is None:
                        box.blocked_since = now
                    break
                except zmq.ZMQError as e:
                    if e.errno != errno.EHOSTUNREACH:
                        raise
                    # the peer's connection is gone: drop its answers and its session
                    self.counters.errors += 1
                    del self._out[peer]
                    self._sessions.pop(peer, None)
                    box = None
                    break
                last = len(item.frames) - 1
                for j, f in enumerate(item.frames):
                    self._sock.send(f, zmq.SNDMORE if j < last else 0, copy=j == 0)
                box.items.popleft()
                box.blocked_since = None
                budget -= 1
                sent += 1
            if box is None:
                continue
            if not box.items:
                del self._out[peer]
            elif box.blocked_since is not None and now - box.blocked_since > self._stall_timeout_s:
                self.counters.timeouts += 1
                log.warning("p2p server %s: peer %r took nothing for %.1f s; dropped its %d "
                            "queued answers", self.endpoint,
                            getattr(self._sessions.get(peer), "name", "?"),
                            now - box.blocked_since, len(box.items))
                del self._out[peer]
        return sent


# --------------------------------------------------------------------------- client


@dataclass
class FetchResult:
    """What :meth:`ChunkClient.fetch` did, index-aligned with its keys: ``outcomes[i]``
    (OK: ``dests[i]`` holds the verified chunk; MISS: the peer has no such chunk;
    CORRUPT: the bytes failed the CRC-32C or had the wrong length, and the destination is
    not to be used; ERROR: not answered: timeout, peer gone, refused, circuit open),
    ``details[i]`` (why, in words; "" for OK/MISS), ``nbytes[i]`` (bytes received for an
    OK key), and the call's wall time ``seconds``."""

    outcomes: list[Outcome]
    details: list[str]
    nbytes: list[int]
    seconds: float = 0.0

    @classmethod
    def failed(cls, n: int, detail: str) -> "FetchResult":
        return cls([Outcome.ERROR] * n, [detail] * n, [0] * n)

    def count(self, outcome: Outcome) -> int:
        return self.outcomes.count(outcome)

    @property
    def all_ok(self) -> bool:
        return all(o == Outcome.OK for o in self.outcomes)


class _PeerFailure(Exception):
    """The peer cannot answer this call (gone, refused, handshake failed)."""

    def __init__(self, detail: str, refused: str = ""):
        super().__init__(detail)
        self.refused = refused


class _Timeout(Exception):
    pass


class ChunkClient:
    """Fetches chunks from one peer's :class:`ChunkServer` into local rows.

    Who calls: a tier worker process (the worker half of the p2p tier), from one thread;
    not thread-safe. Every call blocks at most its ``timeout_s`` (connecting, the hello
    and the answers included), and not at all while the peer's circuit is open.

    ``host``, ``port``: the peer's server. ``fingerprint``, ``hash_seed``: this engine's;
    the server refuses a hello with other values (the call's keys: ERROR
    ``"refused: fingerprint ..."``). ``keys``: this client's :class:`CurveKeyPair` (with
    its secret); ``server_key``: the server's public key (Z85); both required unless
    ``plaintext=True`` (which logs a WARNING). ``circuit``: the peer's
    :class:`PeerCircuit` (default: a new one, 1 s doubling to 60 s). ``context``: the
    ZeroMQ context to use (default: the process's shared ``zmq.Context.instance()``).

    The connection is opened by the first call and kept; a call that fails (timeout,
    disconnect, refusal) closes it, so no late answer is ever read into a row, and the
    next allowed call opens a new one.
    """

    def __init__(self, host: str, port: int, *, fingerprint: str, hash_seed: Any,
                 keys: CurveKeyPair | None = None, server_key: str | bytes | None = None,
                 plaintext: bool = False, name: str = "", circuit: PeerCircuit | None = None,
                 context: zmq.Context | None = None):
        if plaintext:
            if keys is not None or server_key is not None:
                raise ValueError("ChunkClient: plaintext=True takes no keys and no server_key")
        else:
            if keys is None or keys.secret is None:
                raise ValueError("ChunkClient: needs keys= (this client's key pair, with its "
                                 "secret key) unless plaintext=True")
            if server_key is None:
                raise ValueError("ChunkClient: needs server_key= (the peer's public key) "
                                 "unless plaintext=True")
            server_key = parse_key(server_key, "ChunkClient server_key")
        self.peer = f"{host}:{port}"
        self.endpoint = f"tcp://{host}:{port}"
        self.name = name
        self.plaintext = plaintext
        self.counters = TransportCounters()
        self.circuit = circuit if circuit is not None else PeerCircuit()
        self.last_error = ""
        self._keys = keys
        self._server_key = server_key
        self._hello = wire.pack({"t": "hello", "v": wire.PROTOCOL_VERSION, "fp": fingerprint,
                                 "seed": hash_seed, "name": name})
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._mon: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None
        self._ready = False
        self._disconnected = False
        self._rid = 0
        if plaintext:
            _plaintext_warning("client of", self.endpoint)

    # ------------------------------------------------------------------ calls

    def fetch(self, keys: Sequence[bytes], dests: Sequence[Any], timeout_s: float) -> FetchResult:
        """Fetch ``keys[i]`` into ``dests[i]`` (a writable contiguous buffer of exactly the
        chunk's size: a numpy row slice, a memoryview of an arena row).

        Blocks at most ``timeout_s``. Never raises for the peer's sake: every key gets an
        outcome (see :class:`FetchResult`); raises ValueError for a malformed call
        (lengths differ, a read-only or non-contiguous destination, more than
        ``wire.MAX_KEYS`` keys, a key that is not 1..``wire.MAX_KEY_LEN`` bytes)."""
        t0 = time.monotonic()
        n = len(keys)
        if len(dests) != n:
            raise ValueError(f"fetch: {n} keys but {len(dests)} destinations")
        keys = wire.check_keys({"keys": list(keys)})  # ProtocolError is a ValueError
        views = [_byte_view(d, writable=True, what=f"destination {i}")
                 for i, d in enumerate(dests)]
        if n == 0:
            return FetchResult([], [], [])
        if not self.circuit.allow():
            self.counters.fast_failures += 1
            return self._fast_fail(n, t0)
        deadline = t0 + timeout_s
        result = FetchResult([Outcome.ERROR] * n, [""] * n, [0] * n)
        answered = [False] * n
        pending = n
        request = {"t": "fetch", "keys": keys}
        try:
            rid = self._request(request, deadline)
            self.counters.requests += 1
            rehello = False
            while pending:
                msg = self._next(deadline)
                if msg.get("rid") != rid or msg["t"] not in ("chunk", "refused", "error"):
                    self._discard_rest()
                    continue
                if msg["t"] != "chunk":
                    self._discard_rest()
                    if msg.get("reason") == "no_hello" and not rehello and pending == n:
                        rehello = True  # the server lost our session (restarted): once more
                        self._ready = False
                        rid = self._request(request, deadline)
                        continue
                    raise self._refusal(msg)
                i = msg.get("i")
                if not isinstance(i, int) or not 0 <= i < n or answered[i]:
                    self._discard_rest()
                    self.counters.errors += 1
                    continue
                answered[i] = True
                pending -= 1
                self._take_chunk(msg, keys[i], views[i], result, i)
        except _Timeout:
            self.counters.timeouts += 1
            self._fail(result, answered, f"timeout: no answer within {timeout_s:g} s")
        except _PeerFailure as e:
            self._fail(result, answered, str(e), e.refused)
        else:
            self._succeeded()
        result.seconds = time.monotonic() - t0
        return result

    def lookup(self, keys: Sequence[bytes], timeout_s: float) -> list[bool] | None:
        """Which of ``keys`` the peer holds now (index-aligned bools), or None when it
        did not answer within ``timeout_s`` (or refused us, or its circuit is open;
        :attr:`last_error` says which). Blocks at most ``timeout_s``."""
        keys = wire.check_keys({"keys": list(keys)})
        if not keys:
            return []
        if not self.circuit.allow():
            self.counters.fast_failures += 1
            self.last_error = f"circuit open: retry in {self.circuit.retry_in():.2f} s"
            return None
        deadline = time.monotonic() + timeout_s
        request = {"t": "lookup", "keys": keys}
        try:
            rid = self._request(request, deadline)
            self.counters.lookups += 1
            rehello = False
            while True:
                msg = self._next(deadline)
                self._discard_rest()
                if msg.get("rid") != rid:
                    continue
                if msg["t"] != "lookup_resp":
                    if msg.get("reason") == "no_hello" and not rehello:
                        rehello = True
                        self._ready = False
                        rid = self._request(request, deadline)
                        continue
                    raise self._refusal(msg)
                hits = msg.get("hits")
                if not isinstance(hits, list) or len(hits) != len(keys):
                    raise _PeerFailure(f"malformed lookup answer from {self.peer}")
                self._succeeded()
                return [bool(h) for h in hits]
        except _Timeout:
            self.counters.timeouts += 1
            self._fail(None, None, f"timeout: no answer within {timeout_s:g} s")
        except _PeerFailure as e:
            self._fail(None, None, str(e), e.refused)
        return None

    def connect(self, timeout_s: float) -> bool:
        """Open the session now (handshake and hello) instead of on the first call;
        True if it is open. Blocks at most ``timeout_s``; same failure handling as a call."""
        if not self.circuit.allow():
            self.counters.fast_failures += 1
            self.last_error = f"circuit open: retry in {self.circuit.retry_in():.2f} s"
            return False
        try:
            self._open(time.monotonic() + timeout_s)
        except _Timeout:
            self.counters.timeouts += 1
            self._fail(None, None, f"timeout: no hello answer within {timeout_s:g} s")
            return False
        except _PeerFailure as e:
            self._fail(None, None, str(e), e.refused)
            return False
        self._succeeded()
        return True

    def close(self) -> None:
        """Close the connection (nothing waits to be sent). Idempotent. The context is
        the caller's (or the process's shared one) and stays open."""
        self._reset()

    def __enter__(self) -> "ChunkClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _fast_fail(self, n: int, t0: float) -> FetchResult:
        detail = f"circuit open: retry in {self.circuit.retry_in():.2f} s ({self.last_error})"
        result = FetchResult.failed(n, detail)
        result.seconds = time.monotonic() - t0
        return result

    def _take_chunk(self, msg: dict, key: bytes, view: memoryview, result: FetchResult,
                    i: int) -> None:
        st = msg.get("st")
        if msg.get("key") != key:
            self._discard_rest()
            result.outcomes[i] = Outcome.CORRUPT
            result.details[i] = "key: the answer names another key"
            self.counters.errors += 1
        elif st == "miss":
            self._discard_rest()
            result.outcomes[i] = Outcome.MISS
            self.counters.misses += 1
        elif st != "ok" or not self._sock.rcvmore:
            self._discard_rest()
            result.details[i] = f"peer error: {msg.get('why', st)}"
        else:
            n = msg.get("n")
            # into the row; a frame of another size is received into nothing (discarded)
            got = self._sock.recv_into(view if n == view.nbytes else bytearray())
            self._discard_rest()
            if n != view.nbytes or got != n:
                result.outcomes[i] = Outcome.CORRUPT
                result.details[i] = (f"length: peer sent {got} bytes (header {n}) for a "
                                     f"{view.nbytes}-byte destination")
                self.counters.errors += 1
            elif crc32c(view) != msg.get("crc"):
                result.outcomes[i], result.details[i] = Outcome.CORRUPT, "checksum"
                self.counters.checksum_failures += 1
            else:
                result.outcomes[i] = Outcome.OK
                result.nbytes[i] = got
                self.counters.chunks += 1
                self.counters.bytes_received += got

    def _refusal(self, msg: dict) -> _PeerFailure:
        reason = str(msg.get("reason", "?"))
        what = "refused" if msg["t"] == "refused" else "error"
        return _PeerFailure(f"{what} by {self.peer}: {reason} ({msg.get('detail', '')})",
                            reason if what == "refused" else "")

    def _fail(self, result: FetchResult | None, answered: list[bool] | None, detail: str,
              refused: str = "") -> None:
        if result is not None:
            for i, done in enumerate(answered):
                if not done:
                    result.outcomes[i], result.details[i] = Outcome.ERROR, detail
        if refused:
            self.counters.refuse(refused)
        else:
            self.counters.errors += 1
        self.last_error = detail
        was_closed = self.circuit.failures == 0
        self.circuit.record_failure()
        if was_closed:
            log.warning("p2p peer %s failed: %s; failing its calls fast for %.1f s",
                        self.peer, detail, self.circuit.backoff_s)
        self._reset()

    def _succeeded(self) -> None:
        if self.circuit.failures:
            log.info("p2p peer %s answers again", self.peer)
        self.circuit.record_success()
        self.last_error = ""

    def _open(self, deadline: float) -> None:
        """Make sure a session is open: socket, handshake, hello; raises _Timeout or
        _PeerFailure."""
        if self._sock is not None:
            self._drain_monitor()
            if self._disconnected:  # dropped while idle (peer restarted): start again
                self._reset()
        if self._ready:
            return
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.reconnect_ivl = 100
            sock.rcvhwm = RECV_HWM
            if not self.plaintext:
                sock.curve_secretkey = self._keys.secret
                sock.curve_publickey = self._keys.public
                sock.curve_serverkey = self._server_key
            self._mon = sock.get_monitor_socket(_HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED)
            self._sock = sock
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(self._mon, zmq.POLLIN)
            sock.connect(self.endpoint)
        try:
            self._sock.send(self._hello, zmq.NOBLOCK)
        except zmq.Again:
            raise _PeerFailure(f"cannot queue the hello to {self.peer}") from None
        while True:
            msg = self._next(deadline)
            self._discard_rest()
            if msg["t"] == "hello_ok":
                self._ready = True
                self.counters.handshakes += 1
                return
            if msg["t"] in ("refused", "error") and msg.get("rid", 0) == 0:
                raise self._refusal(msg)

    def _request(self, msg: dict, deadline: float) -> int:
        """Open the session if needed and send ``msg`` with a new request id (returned)."""
        self._open(deadline)
        return self._send(msg)

    def _send(self, msg: dict) -> int:
        self._rid += 1
        msg["rid"] = self._rid
        try:
            self._sock.send(wire.pack(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise _PeerFailure(f"send queue to {self.peer} is full") from None
        return self._rid

    def _next(self, deadline: float) -> dict:
        """The header of the next message (its data frame, if any, left to read);
        raises _Timeout at the deadline, _PeerFailure when the monitor says the peer is
        gone or refused us (messages that arrived before are still returned first)."""
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                frame = None
            if frame is not None:
                try:
                    return wire.unpack(frame.buffer)
                except wire.ProtocolError:
                    self._discard_rest()
                    self.counters.errors += 1
                    continue
            if self._disconnected:
                raise _PeerFailure(f"peer {self.peer} disconnected")
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout()
            events = dict(self._poller.poll(max(1, math.ceil(left * 1000))))
            if self._mon in events:
                self._drain_monitor()

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                self._disconnected = True
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise _PeerFailure(f"refused by {self.peer} at the CurveZMQ handshake (ZAP "
                                   f"status {event['value']}: this client's public key is not "
                                   f"in the peer's allow-list)", "auth")
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                raise _PeerFailure(f"CurveZMQ handshake with {self.peer} failed (the peer's "
                                   f"public key is not the server_key given, or it does not "
                                   f"speak the same mechanism)", "handshake")

    def _discard_rest(self) -> None:
        while self._sock is not None and self._sock.rcvmore:
            self._sock.recv(copy=False)

    def _reset(self) -> None:
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._mon.close(linger=0)
            self._sock.close(linger=0)
        self._sock = self._mon = self._poller = None
        self._ready = False
        self._disconnected = False
