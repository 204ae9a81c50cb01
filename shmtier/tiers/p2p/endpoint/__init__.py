"""The p2p tier's endpoint process: everything that runs there, and only that.

One process per engine, spawned and supervised by the tier's scheduler half
(``shmtier/tiers/p2p/supervisor.py``) as ``python -m shmtier.tiers.p2p.endpoint``
(``__main__.py``); the scheduler process imports none of these modules.

- ``process.py``: the process itself (``Endpoint``: the PAIR socket to the scheduler
  half, the server, one client thread per peer, on the engine's arena rows; ``main``).
- ``transport.py``: the message flow between engines, and where to import the transport
  from: ``ChunkServer`` (``server.py``: serves arena rows to admitted peers) and
  ``ChunkClient`` (``client.py``: fetches them into local rows).
- ``wire.py``: the msgpack control messages between engines; ``counters.py``:
  ``TransportCounters``; ``circuit.py``: ``PeerCircuit``, the per-peer circuit breaker.

What it shares with other processes stays one folder up: ``keys.py`` (CurveZMQ keys,
also read by the scheduler half's config check and the operator's shell) and
``status.py`` (the status file it writes, which the ``shmtier`` CLI reads).

Importing this package imports nothing; each module needs pyzmq (extra ``p2p``).
"""
