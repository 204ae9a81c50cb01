"""The ``p2p`` tier: engines fetch KV chunks from each other over ZeroMQ with CurveZMQ (issue 13).

By the process that runs it:

- every process that builds the spec: ``config.py`` (``P2PTierConfig``), ``keys.py``
  (CurveZMQ key pairs in files or config and the allow-list of peer keys; also the
  endpoint's, and a command line to make keys: ``python -m shmtier.tiers.p2p.keys
  generate DIR NAME``).
- the scheduler process: ``scheduler.py`` (``P2PTierManager``, the scheduler half:
  requests, loads, parks, lookups), ``requests.py`` (a request's role and the peer it is
  bound to), ``peer_metrics.py`` (its metrics) and ``supervisor.py`` (the endpoint
  process: spawn, channel, backoff, watchdog, reaping).
- the endpoint process (one per engine): ``endpoint/`` (its main loop, a ChunkServer and
  one ChunkClient per peer, on the engine's arena rows; the transport between engines).
- both of them: ``channel.py`` (the control channel between the scheduler half and its
  endpoint: every message, typed, its encoding and the channel version).
- the ``shmtier`` CLI and the endpoint: ``status.py`` (each endpoint's sessions in a
  status file, ``p2p_sessions`` that reads them on the engine's host, and ``P2PStatus``,
  the tier's part of ``shmtier top``; no zmq needed); ``socket_dirs.py`` (the socket
  directory of each engine's tier, and ``P2PFsck``, which removes those of dead engines
  for the segment guardian and ``shmtier clean``).

Importing this package imports nothing; each module but ``status.py``, ``socket_dirs.py``,
``channel.py`` and ``peer_metrics.py``/``requests.py`` needs pyzmq (extra ``p2p``).
"""
