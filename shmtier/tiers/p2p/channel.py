"""The control channel between the p2p tier's scheduler half and its endpoint process:
every message, typed, and its encoding, versioned.

Runs in: the scheduler process (``supervisor.py``, ``scheduler.py``: under the tiering
manager's lock) and the p2p endpoint process (``endpoint/process.py``: its main thread
and peer threads). Both sides use only this module for the channel. Pure functions;
nothing blocks. Imports msgpack only (not zmq, torch or vLLM).

The channel is a ZeroMQ PAIR socket on ``ipc://`` (``supervisor.py``). A frame is one
msgpack array of messages; each message is an array ``[tag, field, ...]``, its fields
those of its class below, in order (arrays, not maps keyed ``"t"``: measured here,
``bench/p2p_channel.py`` in bench/README.md). The scheduler half sends what one step
queued as one frame; the endpoint sends one message a frame.

=================== =========================================================== =====
scheduler -> endpoint                                                              tag
=================== =========================================================== =====
:class:`Park`       serve ``rows`` for request ``req`` (until released); ``to``       1
                    = [name, key]: only to that peer
:class:`Complete`   no more rows will be parked for ``req``: its misses are final     2
:class:`Unpark`     serve ``req``'s rows no more                                      3
:class:`Load`       fetch ``keys`` of ``req`` from ``peer`` into ``rows``             4
:class:`Lookup`     ask ``peer`` which of ``keys`` of ``req`` it holds                5
:class:`Release`    tell ``peer`` this engine is done with ``req``                    6
:class:`Answer`     park the hits, then answer the peer's lookup ``tid``              7
:class:`Stop`       exit                                                              8
=================== =========================================================== =====

=================== =========================================================== =====
endpoint -> scheduler                                                              tag
=================== =========================================================== =====
:class:`Ready`      the endpoint runs, on ``port``; its channel ``version``           0
:class:`LoadDone`   a load finished: ``ok`` (indices of the keys fetched), bytes,    20
                    seconds, ``detail`` (why not all, "" when all)
:class:`LookupDone` a lookup's ``hits`` (None: it failed, ``detail`` says why)       21
:class:`Released`   a peer is done with ``req`` (``keys`` None) or with ``keys``     22
                    of it
:class:`ExtLookup`  a peer asks which of ``keys`` of its ``req`` this engine holds   23
:class:`Counters`   the endpoint's transport counters, every second                  24
=================== =========================================================== =====

Version: :data:`VERSION`, carried by the endpoint's first message, :class:`Ready`,
whose tag (0) and first field (the version) are the same in every version. The
scheduler half checks it (:func:`from_endpoint` raises :class:`VersionMismatch` naming
both versions, e.g. for an endpoint of another shmtier version found on the path, or
one older than versioning, whose messages were maps) and kills such an endpoint. Raise
:data:`VERSION` for any change to a message's fields or meaning.

Anything else a side cannot read (an unknown tag, a wrong number of fields, not a
frame) is logged as an ERROR naming it and this side's version, and dropped: never a
KeyError in a loop that serves other messages.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple, Sequence, Union

import msgpack

__all__ = ["VERSION", "VersionMismatch", "Park", "Complete", "Unpark", "Load", "Lookup",
           "Release", "Answer", "Stop", "Ready", "LoadDone", "LookupDone", "Released",
           "ExtLookup", "Counters", "encode", "from_scheduler", "from_endpoint"]

logger = logging.getLogger(__name__)

#: The channel's version (1: the first typed, versioned one; before it, maps keyed "t").
VERSION = 1

_READY = 0
_TO_ENDPOINT: dict[int, type] = {}
_TO_SCHEDULER: dict[int, type] = {}


def _message(tag: int, table: dict[int, type]):
    def register(cls: type) -> type:
        assert tag not in _TO_ENDPOINT and tag not in _TO_SCHEDULER, tag
        cls.TAG = tag
        cls.SIZE = 1 + len(cls._fields)  # on the wire: the tag, then the fields
        table[tag] = cls
        return cls
    return register


# --------------------------------------------------------------- scheduler -> endpoint

@_message(1, _TO_ENDPOINT)
class Park(NamedTuple):
    req: str
    keys: list[bytes]
    rows: list[int]
    to: list[str] | None = None  # [the peer's "host:port", its Curve key or ""]


@_message(2, _TO_ENDPOINT)
class Complete(NamedTuple):
    req: str


@_message(3, _TO_ENDPOINT)
class Unpark(NamedTuple):
    req: str


@_message(4, _TO_ENDPOINT)
class Load(NamedTuple):
    job: int
    req: str
    peer: str
    skey: str | None  # the peer's Curve server key (None: plaintext)
    keys: list[bytes]
    rows: list[int]


@_message(5, _TO_ENDPOINT)
class Lookup(NamedTuple):
    lid: int
    req: str
    peer: str
    skey: str | None
    keys: list[bytes]


@_message(6, _TO_ENDPOINT)
class Release(NamedTuple):
    req: str
    peer: str
    skey: str | None


@_message(7, _TO_ENDPOINT)
class Answer(NamedTuple):
    tid: int
    hits: list[bool]
    req: str
    keys: list[bytes]  # the hits' keys and rows, parked for the peer that asked
    rows: list[int]


@_message(8, _TO_ENDPOINT)
class Stop(NamedTuple):
    pass


# --------------------------------------------------------------- endpoint -> scheduler

@_message(_READY, _TO_SCHEDULER)
class Ready(NamedTuple):
    version: int  # first, in every version: read before anything else
    port: int


@_message(20, _TO_SCHEDULER)
class LoadDone(NamedTuple):
    job: int
    ok: list[int]
    nbytes: int
    seconds: float
    detail: str


@_message(21, _TO_SCHEDULER)
class LookupDone(NamedTuple):
    lid: int
    hits: list[bool] | None
    detail: str


@_message(22, _TO_SCHEDULER)
class Released(NamedTuple):
    req: str
    keys: list[bytes] | None = None


@_message(23, _TO_SCHEDULER)
class ExtLookup(NamedTuple):
    tid: int
    req: str
    peer: str
    keys: list[bytes]


@_message(24, _TO_SCHEDULER)
class Counters(NamedTuple):
    server: dict[str, Any]   # the server's TransportCounters.as_dict()
    served: dict[str, int]   # bytes served per peer name
    clients: dict[str, dict[str, Any]]  # per peer: its client's TransportCounters.as_dict()


ToEndpoint = Union[Park, Complete, Unpark, Load, Lookup, Release, Answer, Stop]
ToScheduler = Union[Ready, LoadDone, LookupDone, Released, ExtLookup, Counters]


class VersionMismatch(RuntimeError):
    """The endpoint speaks another channel version than this scheduler half."""


# a msgpack.Packer keeps its buffer: one per thread (the endpoint's peer threads encode too)
_tls = threading.local()


def encode(messages: Sequence[ToEndpoint | ToScheduler]) -> bytes:
    """One frame of ``messages`` (in order)."""
    try:
        packer = _tls.packer
    except AttributeError:
        packer = _tls.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    return packer.pack([[m.TAG, *m] for m in messages])


def from_scheduler(frame: bytes) -> list[ToEndpoint]:
    """The messages of a frame the scheduler half sent (endpoint process); what cannot be
    read is logged and left out."""
    return _decode(frame, _TO_ENDPOINT, "the scheduler half")


def from_endpoint(frame: bytes) -> list[ToScheduler]:
    """The messages of a frame the endpoint sent (scheduler process); what cannot be read
    is logged and left out. :class:`VersionMismatch` for a :class:`Ready` of another
    version, or a frame of an endpoint older than versions (maps keyed ``"t"``)."""
    return _decode(frame, _TO_SCHEDULER, "the endpoint")


def _decode(frame: bytes, table: dict[int, type], sender: str) -> list:
    try:
        items = msgpack.unpackb(frame, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        _unreadable(sender, f"a frame that is not msgpack ({e})")
        return []
    if type(items) is not list:
        if type(items) is dict and "t" in items and table is _TO_SCHEDULER:
            raise VersionMismatch(_mismatch(None))
        _unreadable(sender, f"a frame that is not an array of messages: {items!r:.80}")
        return []
    out = []
    for item in items:
        try:  # the common case first: a message of this side's version
            cls = table[item[0]]
            if type(item) is list and len(item) == cls.SIZE and (
                    cls is not Ready or item[1] == VERSION):
                out.append(tuple.__new__(cls, item[1:]))
                continue
        except (KeyError, IndexError, TypeError):
            pass
        msg = _diagnose(item, table, sender)
        if msg is not None:
            out.append(msg)
    return out


def _diagnose(item: Any, table: dict[int, type], sender: str) -> Any:
    """``item`` decoded, if a message after all, else None (logged); VersionMismatch
    for a Ready of another version, or a message of an unversioned endpoint."""
    tag = item[0] if type(item) is list and item else None
    cls = table.get(tag) if type(tag) is int else None
    if cls is None:
        if type(item) is dict and "t" in item and table is _TO_SCHEDULER:
            raise VersionMismatch(_mismatch(None))
        what = f"type {tag}" if tag is not None else f"shape {item!r:.80}"
        _unreadable(sender, f"a message of unknown {what}")
        return None
    if cls is Ready and len(item) > 1 and item[1] != VERSION:
        raise VersionMismatch(_mismatch(item[1]))
    if len(item) != cls.SIZE:
        _unreadable(sender, f"a {cls.__name__} message with {len(item) - 1} fields, "
                            f"expected {cls.SIZE - 1} ({', '.join(cls._fields)})")
        return None
    return tuple.__new__(cls, item[1:])


def _mismatch(version: Any) -> str:
    theirs = ("an unversioned channel (maps keyed \"t\": an older shmtier)"
              if version is None else f"channel version {version!r}")
    return (f"the p2p endpoint speaks {theirs}, this scheduler half version {VERSION}: an "
            f"endpoint of another shmtier version (python -m shmtier.tiers.p2p.endpoint "
            f"found another shmtier on the path?)")


def _unreadable(sender: str, what: str) -> None:
    logger.error("p2p channel: %s from %s, dropped (this side speaks channel version %d: "
                 "another shmtier version?)", what, sender, VERSION)
