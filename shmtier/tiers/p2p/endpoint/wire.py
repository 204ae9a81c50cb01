"""The p2p transport's messages: msgpack control dicts and their checks.

Runs in: the p2p endpoint process (its ChunkServer and ChunkClients; and the test and
bench processes that stand in for a peer). Pure functions on bytes; no I/O, never blocks. Also what both ends share: the handshake
monitor events, the plaintext WARNING, the byte-view check of rows.

Every control message is one msgpack map with a ``"t"`` (type) field, as vLLM's p2p
messages are (contract §10.4); chunk bytes travel as a separate, raw ZeroMQ frame after
their ``chunk`` header, never inside msgpack. Types:

=============== =============== ==============================================================
type            direction       fields
=============== =============== ==============================================================
``hello``       client->server  ``v`` protocol version, ``fp`` layout fingerprint, ``seed``
                                hash seed, ``name`` the client's name (for logs)
``hello_ok``    server->client  ``v``, ``name`` the server's name
``refused``     server->client  ``rid`` (0 for a hello), ``reason`` (fingerprint, hash_seed,
                                version, no_hello), ``detail`` (words)
``fetch``       client->server  ``rid`` request id, ``keys`` list of bytes; optional ``req``
                                (str): the tier's request id, the rows the server may serve
``chunk``       server->client  ``rid``, ``i`` index into the request's keys, ``key``, ``st``
                                ``"ok"`` / ``"miss"`` / ``"error"`` / ``"refused"`` (the
                                request is bound to another peer), ``n`` payload bytes,
                                ``crc`` CRC-32C of the payload, ``why`` (error text), ``fin``
                                (with ``"miss"``: the request is complete at the server, the
                                chunk will never come); with ``"ok"`` a second frame
                                follows: the ``n`` payload bytes
``lookup``      client->server  ``rid``, ``keys``; optional ``req`` (a lookup the server's
                                owner answers later: ``ChunkServer.answer_lookup``)
``lookup_resp`` server->client  ``rid``, ``hits`` list of bool, index-aligned with ``keys``
``done``        client->server  ``rid``, ``req``: the client is done with request ``req``
                                (the server may release what it holds for it); no answer
``error``       server->client  ``rid``, ``reason`` (malformed, too_many_keys), ``detail``
=============== =============== ==============================================================
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import zmq

__all__ = ["HANDSHAKE_EVENTS", "PROTOCOL_VERSION", "byte_view", "plaintext_warning", "MAX_KEYS", "MAX_KEY_LEN", "MAX_CONTROL_BYTES", "ProtocolError",
           "pack", "unpack", "check_keys", "check_rid", "check_req", "MAX_REQ_LEN"]

PROTOCOL_VERSION = 1
MAX_KEYS = 4096            # keys in one fetch or lookup
MAX_KEY_LEN = 1024         # bytes of one key (shmtier keys are hashes: tens of bytes)
MAX_REQ_LEN = 256          # characters of a request id (``req``)
MAX_CONTROL_BYTES = 8 << 20  # the server's inbound message limit (ZMQ_MAXMSGSIZE)


class ProtocolError(ValueError):
    """A message that does not follow this module's format; ``reason`` is one word."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def pack(msg: dict) -> bytes:
    """One control message as msgpack bytes."""
    return msgpack.packb(msg, use_bin_type=True)


def unpack(buf: Any) -> dict:
    """A control message from msgpack bytes (or a buffer); :class:`ProtocolError` when
    it is not a msgpack map with a string ``"t"``."""
    try:
        msg = msgpack.unpackb(buf, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for malformed input
        raise ProtocolError("malformed", f"not msgpack ({type(e).__name__})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("malformed", "not a map with a 't' type field")
    return msg


def check_rid(msg: dict) -> int:
    """The message's request id (a non-negative int)."""
    rid = msg.get("rid")
    if not isinstance(rid, int) or isinstance(rid, bool) or rid < 0:
        raise ProtocolError("malformed", f"rid must be an int >= 0, got {rid!r}")
    return rid


def check_req(msg: dict, required: bool = False) -> str | None:
    """The message's ``req`` (a string of 1..MAX_REQ_LEN characters), or None when it has
    none (a :class:`ProtocolError` when ``required``)."""
    req = msg.get("req")
    if req is None and not required:
        return None
    if not isinstance(req, str) or not 0 < len(req) <= MAX_REQ_LEN:
        raise ProtocolError("malformed", f"req must be a string of 1..{MAX_REQ_LEN} "
                                         f"characters, got {req!r:.80}")
    return req


def check_keys(msg: dict) -> list[bytes]:
    """The message's keys: a list of 1..MAX_KEYS byte strings of 1..MAX_KEY_LEN bytes."""
    keys = msg.get("keys")
    if not isinstance(keys, list):
        raise ProtocolError("malformed", "keys must be a list")
    if len(keys) > MAX_KEYS:
        raise ProtocolError("too_many_keys", f"{len(keys)} keys, at most {MAX_KEYS}")
    for k in keys:
        if not isinstance(k, bytes) or not 0 < len(k) <= MAX_KEY_LEN:
            raise ProtocolError("malformed", f"a key must be 1..{MAX_KEY_LEN} bytes")
    return keys


# socket-monitor events that end a CurveZMQ handshake in failure (both ends watch them)
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def plaintext_warning(log: logging.Logger, role: str, endpoint: str) -> None:
    """The WARNING every plaintext endpoint logs once, when it is made."""
    log.warning("p2p %s %s runs in PLAINTEXT mode (plaintext=True): peers are not "
                "authenticated and chunk bytes cross the network unencrypted; use it only "
                "on a trusted network", role, endpoint)


def byte_view(buf: Any, *, writable: bool, what: str) -> memoryview:
    """``buf`` as a flat unsigned-byte memoryview (no copy); ValueError when it is not
    contiguous, or read-only where ``writable`` is asked."""
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
