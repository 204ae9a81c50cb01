"""The fetching end of the p2p transport: ``ChunkClient`` (DEALER, CurveZMQ client) and ``FetchResult``.

Runs in: the p2p endpoint process (``process.py``), one thread per peer that this engine
loads chunks from (and in the test and bench processes that stand in for a peer). Never
runs in the scheduler process. The message flow, the row-memory rule and the failure
handling of both ends: ``transport.py``.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from shmtier.shared.codec import copy_crc32c
from shmtier.shared.jobs import Outcome
from shmtier.tiers.p2p.endpoint import wire
from shmtier.tiers.p2p.endpoint.circuit import PeerCircuit
from shmtier.tiers.p2p.endpoint.counters import TransportCounters
from shmtier.tiers.p2p.keys import CurveKeyPair, parse_key

__all__ = ["ChunkClient", "FetchResult"]

log = logging.getLogger(__name__)

RECV_HWM = 64              # chunk messages a client buffers (~90 MiB of 1.4 MiB chunks)
# A peer that closes a CurveZMQ handshake has either gone (its endpoint died mid-handshake)
# or holds another key than the server_key given (it closes every handshake): the event
# alone does not tell them apart. libzmq reconnects after reconnect_ivl (100 ms + up to as
# much again); its next attempt is the verdict: refused (nothing listens), or closed again.
# Watched for this long at most (then the call fails saying both).
HANDSHAKE_VERDICT_S = 0.5
MONITOR_EVENTS = (wire.HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
                  | zmq.EVENT_HANDSHAKE_SUCCEEDED)
_PROTOCOL_ERRORS = {getattr(zmq, n): n[len("PROTOCOL_ERROR_"):].lower() for n in dir(zmq)
                    if n.startswith("PROTOCOL_ERROR_ZMTP_")}


@dataclass
class FetchResult:
    """What :meth:`ChunkClient.fetch` did, index-aligned with its keys: ``outcomes[i]``
    (OK: ``dests[i]`` holds the verified chunk; MISS: the peer has no such chunk;
    CORRUPT: the bytes failed the CRC-32C or had the wrong length, and the destination is
    not to be used; ERROR: not answered: timeout, peer gone, refused, circuit open),
    ``details[i]`` (why, in words; "" for OK/MISS), ``nbytes[i]`` (bytes received for an
    OK key), ``final[i]`` (a MISS the peer says is final: the request is complete there
    and the chunk will never come; empty when the call sent nothing), and the call's
    wall time ``seconds``."""

    outcomes: list[Outcome]
    details: list[str]
    nbytes: list[int]
    seconds: float = 0.0
    final: list[bool] = field(default_factory=list)

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

    Who calls: the p2p endpoint process (``process.py``: a peer's thread), from one thread;
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
        self._broken = ""  # how the peer closed a handshake, while its reconnect is watched
        self._broken_until = 0.0
        self._rid = 0
        if plaintext:
            wire.plaintext_warning(log, "client of", self.endpoint)

    # ------------------------------------------------------------------ calls

    def fetch(self, keys: Sequence[bytes], dests: Sequence[Any], timeout_s: float,
              req: str | None = None) -> FetchResult:
        """Fetch ``keys[i]`` into ``dests[i]`` (a writable contiguous buffer of exactly the
        chunk's size: a numpy row slice, a memoryview of an arena row). ``req``: the
        request whose rows the server is to serve (its ``request_provider``).

        Blocks at most ``timeout_s``. Never raises for the peer's sake: every key gets an
        outcome (see :class:`FetchResult`); raises ValueError for a malformed call
        (lengths differ, a read-only or non-contiguous destination, more than
        ``wire.MAX_KEYS`` keys, a key that is not 1..``wire.MAX_KEY_LEN`` bytes)."""
        return self.fetch_many([(keys, dests, req)], timeout_s)[0]

    def fetch_many(self, calls: Sequence[tuple], timeout_s: float) -> list[FetchResult]:
        """Several fetches pipelined on the one connection: ``calls`` is a list of
        ``(keys, dests, req)`` (each as :meth:`fetch` takes them); every request is sent
        first, then the answers are taken as they arrive, in whatever order, each into its
        own call's destination by request id and key index. One result per call, as
        :meth:`fetch` gives it (a chunk that fails its checksum fails only that key).

        Blocks at most ``timeout_s`` for all of them together; a timeout, a refused session
        or a peer gone fails every key still unanswered, in every call. Raises ValueError
        (before sending anything) for a malformed call."""
        t0 = time.monotonic()
        todo = []  # (index into calls, keys, views, request message)
        results: list[FetchResult | None] = [None] * len(calls)
        for c, (keys, dests, req) in enumerate(calls):
            n = len(keys)
            if len(dests) != n:
                raise ValueError(f"fetch: {n} keys but {len(dests)} destinations")
            keys = wire.check_keys({"keys": list(keys)})  # ProtocolError is a ValueError
            views = [wire.byte_view(d, writable=True, what=f"destination {i}")
                     for i, d in enumerate(dests)]
            request = {"t": "fetch", "keys": keys}
            if req is not None:
                request["req"] = wire.check_req({"req": req})
            if n == 0:
                results[c] = FetchResult([], [], [])
            else:
                todo.append((c, keys, views, request))
        if not todo:
            return results
        if not self.circuit.allow():
            self.counters.fast_failures += len(todo)
            for c, keys, _, _ in todo:
                results[c] = self._fast_fail(len(keys), t0)
            return results
        deadline = t0 + timeout_s
        answered = {}
        for c, keys, _, _ in todo:
            n = len(keys)
            results[c] = FetchResult([Outcome.ERROR] * n, [""] * n, [0] * n, final=[False] * n)
            answered[c] = [False] * n
        pending = sum(len(keys) for _, keys, _, _ in todo)
        total = pending
        try:
            rids = self._send_fetches(todo, deadline)  # rid -> (c, keys, views)
            self.counters.requests += len(todo)
            rehello = False
            while pending:
                msg = self._next(deadline)
                call = rids.get(msg.get("rid"))
                if call is None or msg["t"] not in ("chunk", "refused", "error"):
                    self._discard_rest()
                    continue
                if msg["t"] != "chunk":
                    self._discard_rest()
                    if msg.get("reason") == "no_hello" and not rehello and pending == total:
                        rehello = True  # the server lost our session (restarted): once more
                        self._ready = False
                        rids = self._send_fetches(todo, deadline)
                        continue
                    raise self._refusal(msg)
                c, keys, views = call
                i = msg.get("i")
                if not isinstance(i, int) or not 0 <= i < len(keys) or answered[c][i]:
                    self._discard_rest()
                    self.counters.errors += 1
                    continue
                answered[c][i] = True
                pending -= 1
                self._take_chunk(msg, keys[i], views[i], results[c], i)
        except _Timeout:
            self.counters.timeouts += 1
            self._fail_calls(results, answered, f"timeout: no answer within {timeout_s:g} s")
        except _PeerFailure as e:
            self._fail_calls(results, answered, str(e), e.refused)
        else:
            self._succeeded()
        seconds = time.monotonic() - t0
        for c in answered:
            results[c].seconds = seconds
        return results

    def _send_fetches(self, todo: list, deadline: float) -> dict:
        """Send every fetch request of ``todo`` (opening the session first if needed);
        returns request id -> (call index, keys, views)."""
        rids = {}
        for c, keys, views, request in todo:
            rids[self._request(request, deadline)] = (c, keys, views)
        return rids

    def _fail_calls(self, results: list, answered: dict, detail: str, refused: str = "") -> None:
        for c, done in answered.items():
            for i, ok in enumerate(done):
                if not ok:
                    results[c].outcomes[i], results[c].details[i] = Outcome.ERROR, detail
        self._fail(detail, refused)

    def lookup(self, keys: Sequence[bytes], timeout_s: float,
               req: str | None = None) -> list[bool] | None:
        """Which of ``keys`` the peer holds now (index-aligned bools), or None when it
        did not answer within ``timeout_s`` (or refused us, or its circuit is open;
        :attr:`last_error` says which). Blocks at most ``timeout_s``. With ``req`` the
        server's owner answers (and may hold the hits for that request until ``done``)."""
        keys = wire.check_keys({"keys": list(keys)})
        if not keys:
            return []
        if not self.circuit.allow():
            self.counters.fast_failures += 1
            self.last_error = f"circuit open: retry in {self.circuit.retry_in():.2f} s"
            return None
        deadline = time.monotonic() + timeout_s
        request = {"t": "lookup", "keys": keys}
        if req is not None:
            request["req"] = wire.check_req({"req": req})
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
            self._fail(f"timeout: no answer within {timeout_s:g} s")
        except _PeerFailure as e:
            self._fail(str(e), e.refused)
        return None

    def done(self, req: str, timeout_s: float, keys: list[bytes] | None = None) -> bool:
        """Tell the peer this client is done with request ``req`` (it releases what it
        holds for it), or only with ``keys`` of it (fetched; the rest stays held for a
        later fetch of the same request); no answer is awaited. True if sent; a peer that
        cannot be reached is not counted as a failure (it holds nothing it can serve once
        gone)."""
        msg = {"t": "done", "req": req}
        if keys is not None:
            msg["keys"] = list(keys)
            wire.check_keys(msg)
        wire.check_req(msg, required=True)
        if not self.circuit.allow():
            return False
        try:
            self._request(msg, time.monotonic() + timeout_s)
        except (_Timeout, _PeerFailure):
            self._reset()
            return False
        return True

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
            self._fail(f"timeout: no hello answer within {timeout_s:g} s")
            return False
        except _PeerFailure as e:
            self._fail(str(e), e.refused)
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
            result.final[i] = bool(msg.get("fin"))
            self.counters.misses += 1
        elif st != "ok" or not self._sock.rcvmore:
            self._discard_rest()
            result.details[i] = f"peer error: {msg.get('why', st)}"
        else:
            n = msg.get("n")
            # libzmq's message as is, then one pass that copies it into the row and
            # checksums it (copy_crc32c); a frame of another size is not copied
            frame = self._sock.recv(copy=False)
            got = len(frame)
            self._discard_rest()
            if n != view.nbytes or got != n:
                result.outcomes[i] = Outcome.CORRUPT
                result.details[i] = (f"length: peer sent {got} bytes (header {n}) for a "
                                     f"{view.nbytes}-byte destination")
                self.counters.errors += 1
            elif copy_crc32c(view, frame.buffer) != msg.get("crc"):
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

    def _fail(self, detail: str, refused: str = "") -> None:
        """Count a failed call, open the peer's circuit and drop the connection."""
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
            self._mon = sock.get_monitor_socket(MONITOR_EVENTS)
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
            if self._disconnected and not self._broken:
                raise _PeerFailure(f"peer {self.peer} disconnected")
            until = min(deadline, self._broken_until) if self._broken else deadline
            left = until - time.monotonic()
            if left <= 0:
                if self._broken:
                    raise _PeerFailure(
                        f"{self._mechanism} handshake with {self.peer} failed "
                        f"({self._broken}) and its next connection did not end within "
                        f"{HANDSHAKE_VERDICT_S:g} s: the peer's endpoint went away, or "
                        f"{self._closes_every_handshake}", "handshake")
                raise _Timeout()
            events = dict(self._poller.poll(max(1, math.ceil(left * 1000))))
            if self._mon in events:
                self._drain_monitor()

    def _drain_monitor(self) -> None:
        """Take the socket's monitor events; raises _PeerFailure for a refused or
        failed handshake, saying which (see HANDSHAKE_VERDICT_S)."""
        while True:
            try:
                event = parse_monitor_message(self._mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, value = event["event"], int(event["value"])
            if kind == zmq.EVENT_DISCONNECTED:
                self._disconnected = True
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise _PeerFailure(f"refused by {self.peer} at the CurveZMQ handshake (ZAP "
                                   f"status {value}: this client's public key is not "
                                   f"in the peer's allow-list)", "auth")
            elif (kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
                raise _PeerFailure(f"CurveZMQ handshake with {self.peer} failed: the peer "
                                   f"does not speak CurveZMQ (plaintext?)", "handshake")
            elif (kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC) or (
                    self._broken and kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                              zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)):
                # it took the connection again and closed this handshake too (or its
                # answer did not decrypt): it is there, and holds another key
                raise _PeerFailure(
                    f"{self._mechanism} handshake with {self.peer} failed"
                    f"{' twice' if self._broken else ''} ({self._broken or _why(kind, value)}): "
                    f"{self._closes_every_handshake}", "handshake")
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                self._broken = _why(kind, value)  # gone, or another key: see its reconnect
                self._broken_until = time.monotonic() + HANDSHAKE_VERDICT_S
            elif self._broken and kind == zmq.EVENT_CLOSED:  # the reconnect was refused
                raise _PeerFailure(
                    f"the peer {self.peer} went away during the {self._mechanism} "
                    f"handshake ({self._broken}); nothing listens at {self.peer} now",
                    "handshake")
            elif self._broken and kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                raise _PeerFailure(
                    f"the peer {self.peer} closed the {self._mechanism} handshake "
                    f"({self._broken}) and accepted the next one: its endpoint restarted",
                    "handshake")

    @property
    def _mechanism(self) -> str:
        return "plaintext ZMTP" if self.plaintext else "CurveZMQ"

    @property
    def _closes_every_handshake(self) -> str:
        """Why a peer that is there closes each handshake, in words."""
        if self.plaintext:
            return "the peer closes every plaintext handshake (does it expect CurveZMQ?)"
        return ("the peer's public key is not the server_key given (peers, "
                "remote_public_key, or the allow-list's only key)")

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
        self._broken = ""


def _why(kind: int, value: int) -> str:
    """A failed handshake's monitor event in words: the errno of a closed connection, or
    the ZMTP protocol error."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return f"connection closed: {errno.errorcode.get(value, value)}"
    return f"protocol error {_PROTOCOL_ERRORS.get(value, hex(value))}"
