"""The ``p2p`` tier: engines fetch KV chunks from each other over ZeroMQ with CurveZMQ (issue 13).

The tier: ``config.py`` (``P2PTierConfig``), ``scheduler.py`` (``P2PTierManager``, the
scheduler half) and ``endpoint.py`` (the endpoint process it spawns: a ChunkServer and one
ChunkClient per peer, on the engine's arena rows). The transport:

- ``keys.py``: CurveZMQ key pairs in files or config, the allow-list of peer keys, and a
  command line to make keys (``python -m shmtier.tiers.p2p.keys generate DIR NAME``).
- ``transport.py``: the message flow, and where to import the transport from:
  ``ChunkServer`` (``server.py``: serves arena rows to admitted peers) and ``ChunkClient``
  (``client.py``: fetches them into local rows), both for tier worker processes.
- ``wire.py``: the msgpack control messages; ``counters.py``: ``TransportCounters``;
  ``circuit.py``: ``PeerCircuit``, the per-peer circuit breaker with backoff.
- ``status.py``: each endpoint's sessions in a status file, and ``p2p_sessions`` that
  reads them on the engine's host (for the ``shmtier`` CLI; no zmq needed).

Importing this package imports nothing; each module but ``status.py`` needs pyzmq
(extra ``p2p``).
"""
