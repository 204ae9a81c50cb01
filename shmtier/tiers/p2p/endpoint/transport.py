"""The p2p tier's transport: a ChunkServer that serves arena rows, a ChunkClient that fetches them.

Runs in: the p2p endpoint process only (``process.py``; and the test and bench processes
that stand in for a peer). Both classes do network I/O; the scheduler process never
imports them (it must never block on the network). Built on pyzmq (ROUTER/DEALER over
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
    {t:fetch, rid, keys[, req]} ───────────────────────▶ req bound to another peer? then per
                                                          key {st:refused}, counted
                                                          per key, in order, as the peer's
                                                          send queue has room:
                                                          view, crc = provider(key) (the CRC
                                                          computed when the row was parked),
                                                          or view and crc = crc32c(view)
    copy_crc32c(dest row, frame) ◀── [{t:chunk, rid, i, key, st:ok, n, crc}, view (zero-copy frame)]
    (copied and checksummed in one pass) == crc ? OK : CORRUPT
                        ◀── [{t:chunk, rid, i, key, st:miss[, fin]}]  -> MISS (fin: final,
                                                          the request is complete at the server)
                        ◀── [{t:chunk, rid, i, key, st:refused, why}] -> ERROR (bound elsewhere)
                        ◀── [{t:chunk, rid, i, key, st:error, why}]   -> ERROR (provider failed)
    {t:done, rid, req[, keys]} ────────────────────────▶ on_done(req, keys): release it, or
                                                          only those keys (no answer)

A client call has one deadline: connecting, the hello and the answers all fit in its
``timeout_s``; what is not answered by then is ERROR, the socket is dropped (late answers
are never read into a row) and the peer's :class:`PeerCircuit` opens: later calls fail at
once until its backoff expires. A peer that drops the connection (killed) fails the call
as soon as the client's socket monitor says so; one restarted between calls is met with a
new connection and hello by the next call (or, if its restart went unseen, its ``no_hello``
answer makes the client say hello once more within the same deadline). A handshake the
peer closes fails the call saying why, after watching libzmq's next connection (at most
``client.HANDSHAKE_VERDICT_S``): refused, the peer went away mid-handshake; closed again,
its public key is not the ``server_key`` given. The server never
blocks on one peer: its
sends are non-blocking and a peer whose queue is full waits in its own outbox
(``stall_timeout_s``, then dropped) while the others are served.

Row memory: the server sends the provider's memoryview without copying it (libzmq sends
from it later, in its I/O thread); the bytes must not change until sent, or the client's
CRC check fails (CORRUPT: never wrong bytes, but a wasted fetch). The client takes each
chunk's frame as libzmq received it (``recv(copy=False)``) and copies it into its
destination view while checksumming it (``copy_crc32c``: one pass, one copy, non-temporal
stores into the row). A destination whose outcome is not OK holds undefined bytes.

Modules: ``server.py`` (``ChunkServer``), ``client.py`` (``ChunkClient``, ``FetchResult``),
``wire.py`` (the messages and what both ends share), ``circuit.py`` (``PeerCircuit``),
``counters.py`` (``TransportCounters``), ``keys.py`` (key pairs, ``AllowList``). Import the
classes from here.
"""

from __future__ import annotations

from shmtier.tiers.p2p.endpoint.circuit import PeerCircuit
from shmtier.tiers.p2p.endpoint.client import ChunkClient, FetchResult
from shmtier.tiers.p2p.endpoint.counters import TransportCounters
from shmtier.tiers.p2p.endpoint.server import ChunkServer, LookupToken, Provider, RequestProvider

__all__ = ["ChunkClient", "ChunkServer", "FetchResult", "LookupToken", "PeerCircuit", "Provider", "RequestProvider",
           "TransportCounters"]
