"""The ``p2p`` tier: engines fetch KV chunks from each other over ZeroMQ with CurveZMQ (issue 13).

This package holds the transport so far (no tier registry entry yet):

- ``keys.py``: CurveZMQ key pairs in files or config, the allow-list of peer keys, and a
  command line to make keys (``python -m shmtier.tiers.p2p.keys generate DIR NAME``).
- ``transport.py``: the message flow, and where to import the transport from:
  ``ChunkServer`` (``server.py``: serves arena rows to admitted peers) and ``ChunkClient``
  (``client.py``: fetches them into local rows), both for tier worker processes.
- ``wire.py``: the msgpack control messages; ``counters.py``: ``TransportCounters``;
  ``circuit.py``: ``PeerCircuit``, the per-peer circuit breaker with backoff.

Importing this package imports nothing; each module needs pyzmq (extra ``p2p``).
"""
