"""The serving end of the p2p transport: ``ChunkServer`` (ROUTER, CurveZMQ server, ZAP handler).

Runs in: the p2p endpoint process (``process.py``) that serves an engine's chunks to its
peers, on its main thread (the :meth:`ChunkServer.poll` loop), and in the test and bench
processes that stand in for a peer. Never runs in the scheduler process. The message
flow, the row-memory rule and the failure handling of both ends: ``transport.py``.

Over 600 lines: one class whose state (sessions, bindings, ZAP answers) one thread owns.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from shmtier.shared.codec import crc32c
from shmtier.tiers.p2p.endpoint import wire
from shmtier.tiers.p2p.endpoint.counters import TransportCounters
from shmtier.tiers.p2p.keys import AllowList, CurveKeyPair

__all__ = ["ChunkServer", "LookupToken", "Provider", "RequestOwner", "RequestProvider"]

log = logging.getLogger(__name__)

Provider = Callable[[bytes], Any]  # key -> a buffer of the chunk's bytes, (buffer, crc), or None
RequestProvider = Callable[[str, bytes], Any]  # (req, key) -> as Provider
# req -> the (name, key) of the one peer that may ask for it ("" = not checked), or None
RequestOwner = Callable[[str], "tuple[str, str] | None"]


@dataclass(frozen=True)
class LookupToken:
    """A lookup the server's owner answers later (:meth:`ChunkServer.answer_lookup`):
    the peer's routing id, its request id, how many keys, the peer's name (its hello)
    and its Curve public key (Z85, authenticated by the handshake; "" in plaintext)."""

    peer: bytes
    rid: int
    n: int
    name: str
    key: str = ""

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"shmtier-p2p"
SEND_HWM = 256             # messages queued in libzmq per peer before the server's outbox
FLUSH_BUDGET = 16          # chunks sent per peer per poll round (fairness between peers)
BLOCKED_RETRY_S = 0.002    # how often a server retries a peer whose send queue was full
MAX_SESSIONS = 1024        # hello sessions the server remembers (oldest dropped)
MAX_PEER_NAMES = 64        # peers whose served bytes are counted by name (the rest: "other")
_RECV_BATCH = 64           # inbound messages a server handles per poll round

_PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "handshake_crypto",
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "handshake_mechanism",
}


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
    req: str | None = None


@dataclass
class _Outbox:
    items: collections.deque = field(default_factory=collections.deque)
    blocked_since: float | None = None


class ChunkServer:
    """Serves the chunks of one engine to its admitted peers.

    Who calls: the p2p endpoint process that serves peers (one per engine and
    data-parallel rank), on its main thread: construct it, then call :meth:`poll` in its loop (or :meth:`serve`),
    :meth:`close` at the end. Not thread-safe.

    ``host``, ``port``: where the ROUTER socket binds (``port=0``: a free port, read back
    from :attr:`port`). ``provider(key)``: the chunk's bytes (a buffer: a memoryview of an
    arena row, a numpy row) or None (MISS), or ``(buffer, crc)`` where ``crc`` is the
    buffer's CRC-32C computed earlier (when the row was parked: the server then does not
    read the row, and a row changed since fails the client's check); it is called when the
    chunk is about to be sent; an exception (or a ``crc`` that is not an int in
    0..2**32-1) becomes an ``"error"`` answer for that key. ``has(key)``: answers
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

    Requests scoped to a tier request (a ``req`` in the message; the p2p tier's use):
    ``request_provider(req, key)`` answers fetches that name ``req`` (the rows the owner
    parked for that request; None: MISS); without it they go to ``provider``.
    ``lookup_handler(token, req, keys)``: a lookup naming ``req`` is handed to the owner,
    who answers it later with :meth:`answer_lookup` (without a handler: ``has``).
    ``on_done(req, keys)``: the peer says it is done with ``req`` (``keys`` None), or with
    those keys of it (no answer is sent).
    ``request_complete(req)``: True when no more chunks will ever be provided for ``req``
    (the owner's request finished): a miss of that request is answered final (``fin``),
    so the client stops asking. ``request_owner(req)``: the one peer that may ask for
    ``req``, as ``(name, key)``: its hello name and its Curve public key (Z85); an empty
    field is not checked; None: any admitted peer. Another peer's fetch, lookup or done
    naming ``req`` is refused (counted ``refused_requests``): its fetch answers each key
    ``"refused"``, its lookup all False, its done nothing; nothing is served to it.

    Construction binds the socket (raises OSError when it cannot, e.g. address in use)
    and never blocks on the network.
    """

    def __init__(self, host: str, port: int, *, provider: Provider, fingerprint: str,
                 hash_seed: Any, keys: CurveKeyPair | None = None,
                 allow: AllowList | None = None, plaintext: bool = False,
                 has: Callable[[bytes], bool] | None = None, name: str = "",
                 stall_timeout_s: float = 30.0,
                 tamper: Callable[[bytes, memoryview], Any] | None = None,
                 request_provider: RequestProvider | None = None,
                 lookup_handler: Callable[[LookupToken, str, list], None] | None = None,
                 on_done: Callable[[str, list | None], None] | None = None,
                 request_complete: Callable[[str], bool] | None = None,
                 request_owner: RequestOwner | None = None):
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
        # chunk bytes sent per admitted peer, by the name its hello gave (MAX_PEER_NAMES
        # names, then "other"): for per-peer metrics and status
        self.peer_bytes: dict[str, int] = {}
        self._provider = provider
        self._has = has
        self._request_provider = request_provider
        self._lookup_handler = lookup_handler
        self._on_done = on_done
        self._request_complete = request_complete
        self._request_owner = request_owner
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
            self._mon = sock.get_monitor_socket(wire.HANDSHAKE_EVENTS)
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
            wire.plaintext_warning(log, "server", self.endpoint)
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

    def watch(self, sock: zmq.Socket) -> None:
        """Make :meth:`poll` also return as soon as ``sock`` (the owner's, used on the
        same thread) has something to read; the owner reads it after ``poll``. For an
        owner that serves other sockets in the same loop without waiting a tick."""
        self._poller.register(sock, zmq.POLLIN)

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
            req = wire.check_req(msg)
            self.counters.requests += 1
            box = self._out.setdefault(peer, _Outbox())
            if not self._may_ask(session, req):
                box.items.extend(_Item(rid, [wire.pack(
                    {"t": "chunk", "rid": rid, "i": i, "key": k, "st": "refused",
                     "why": "not_bound: the request is bound to another peer"})])
                    for i, k in enumerate(keys))
                return
            box.items.extend(_Item(rid, None, i, k, req) for i, k in enumerate(keys))
        elif t == "lookup":
            keys = wire.check_keys(msg)
            req = wire.check_req(msg)
            self.counters.lookups += 1
            if not self._may_ask(session, req):
                self._queue(peer, rid, {"t": "lookup_resp", "rid": rid,
                                        "hits": [False] * len(keys)})
                return
            if req is not None and self._lookup_handler is not None:
                self._call(self._lookup_handler,
                           LookupToken(peer, rid, len(keys), session.name, session.user_id),
                           req, keys)
                return
            self._queue(peer, rid, {"t": "lookup_resp", "rid": rid,
                                    "hits": [self._lookup(k) for k in keys]})
        elif t == "done":
            req = wire.check_req(msg, required=True)
            keys = wire.check_keys(msg) if "keys" in msg else None
            if self._on_done is not None and self._may_ask(session, req):
                self._call(self._on_done, req, keys)
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

    def _may_ask(self, session: _Session, req: str | None) -> bool:
        """May this session ask for request ``req`` (``request_owner``)? A refusal is
        counted and logged once per peer name."""
        if req is None or self._request_owner is None:
            return True
        try:
            owner = self._request_owner(req)
        except Exception as e:  # an owner bug refuses, never kills the loop
            self.counters.errors += 1
            log.error("p2p server %s: request_owner raised %s: %s", self.endpoint,
                      type(e).__name__, e)
            owner = ("\0", "\0")
        if owner is None:
            return True
        name, key = owner
        if (not name or name == session.name) and (not key or key == session.user_id):
            return True
        self.counters.refused_requests += 1
        if ("not_bound", session.name) not in self._logged:
            self._logged.add(("not_bound", session.name))
            log.warning("p2p server %s refused peer %r (key %s) a request bound to another "
                        "peer (%s); further ones are only counted", self.endpoint,
                        session.name, session.user_id or "-", name or key)
        return False

    def answer_lookup(self, token: LookupToken, hits: list) -> bool:
        """Answer a lookup handed to ``lookup_handler`` (``hits``: index-aligned bools);
        False when that peer's session is gone (nothing sent)."""
        if len(hits) != token.n:
            raise ValueError(f"answer_lookup: {len(hits)} answers for {token.n} keys")
        if token.peer not in self._sessions:
            return False
        self._queue(token.peer, token.rid, {"t": "lookup_resp", "rid": token.rid,
                                            "hits": [bool(h) for h in hits]})
        return True

    def _count_peer_bytes(self, peer: bytes, n: int) -> None:
        session = self._sessions.get(peer)
        name = session.name if session is not None and session.name else "?"
        if name not in self.peer_bytes and len(self.peer_bytes) >= MAX_PEER_NAMES:
            name = "other"
        self.peer_bytes[name] = self.peer_bytes.get(name, 0) + n

    def sessions(self) -> list[dict]:
        """The peers this server knows now (most recently active last): ``name`` (what
        its hello said), ``key`` (its Curve public key, Z85; "" in plaintext),
        ``refused`` (why its hello was refused; "" admitted), ``queued`` (answers
        waiting in its outbox), ``bytes_sent`` (chunk bytes sent to that name)."""
        return [{"name": s.name, "key": s.user_id, "refused": s.refused,
                 "queued": len(self._out[peer].items) if peer in self._out else 0,
                 "bytes_sent": self.peer_bytes.get(s.name, 0)}
                for peer, s in self._sessions.items()]

    def _call(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # an owner bug never kills the loop
            self.counters.errors += 1
            log.error("p2p server %s: %s raised %s: %s", self.endpoint,
                      getattr(fn, "__name__", "handler"), type(e).__name__, e)

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
            if item.req is not None and self._request_provider is not None:
                buf = self._request_provider(item.req, key)
            else:
                buf = self._provider(key)
            crc = None
            if isinstance(buf, tuple):  # (buffer, its CRC-32C computed when it was parked)
                buf, crc = buf
                if not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 1 << 32:
                    raise ValueError(f"provided checksum must be a CRC-32C int in "
                                     f"0..2**32-1, got {crc!r:.40}")
            view = None if buf is None else wire.byte_view(buf, writable=False, what="provided row")
        except Exception as e:
            self.counters.errors += 1
            log.error("p2p server %s: provider raised for key %s: %s: %s", self.endpoint,
                      key.hex(), type(e).__name__, e)
            head.update(st="error", why=f"{type(e).__name__}: {e}"[:200])
            return [wire.pack(head)]
        if view is None:
            self.counters.misses += 1
            head["st"] = "miss"
            if item.req is not None and self._request_complete is not None:
                try:
                    if self._request_complete(item.req):
                        head["fin"] = True  # no chunk will come for it: do not ask again
                except Exception as e:
                    self.counters.errors += 1
                    log.error("p2p server %s: request_complete raised %s: %s", self.endpoint,
                              type(e).__name__, e)
            return [wire.pack(head)]
        head.update(st="ok", n=view.nbytes, crc=crc32c(view) if crc is None else crc)
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
                if last:  # a chunk's data frame went
                    self._count_peer_bytes(peer, len(item.frames[1]))
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
