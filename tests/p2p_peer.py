"""Test helper: a p2p ChunkServer in its own process (started with multiprocessing spawn).

``serve(conn, spec)`` is the child's entry point. It builds an arena of rows with the
bytes ``chunk_bytes(key, size)`` for the keys in ``spec["chunks"]``, serves them, sends
``("ready", port, warnings)`` on ``conn``, then answers ``"counters"`` (the server's
counters as a dict) and ``"stop"`` until told to stop or the parent goes away.

Test keys: ``b"slow..."`` keys take ``spec["slow_s"]`` seconds to provide (a server
that is mid-fetch for a while); ``b"flip..."`` keys go through the server's ``tamper``
hook, which flips one byte after the checksum was computed (corrupted in flight).
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np


def chunk_bytes(key: bytes, size: int) -> np.ndarray:
    """The deterministic bytes of test chunk ``key`` (``size`` bytes)."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _flip(key: bytes, view: memoryview):
    data = bytearray(view)
    data[len(data) // 2] ^= 0x01
    return data


def serve(conn, spec: dict) -> None:
    from shmtier.tiers.p2p.keys import AllowList, load_keypair
    from shmtier.tiers.p2p.endpoint.transport import ChunkServer

    collect = _Collect()
    logging.getLogger("shmtier").addHandler(collect)
    chunks = spec["chunks"]  # [(key, size)]
    width = max(size for _, size in chunks)
    arena = np.zeros((len(chunks), width), np.uint8)
    rows = {}
    for r, (key, size) in enumerate(chunks):
        arena[r, :size] = chunk_bytes(key, size)
        rows[key] = memoryview(arena[r, :size])
    slow_s = spec.get("slow_s", 0.0)

    def provider(key: bytes):
        if key.startswith(b"slow"):
            time.sleep(slow_s)
        return rows.get(key)

    plaintext = spec.get("plaintext", False)
    server = ChunkServer(
        "127.0.0.1", spec.get("port", 0), provider=provider, fingerprint=spec["fingerprint"],
        hash_seed=spec["hash_seed"], plaintext=plaintext,
        keys=None if plaintext else load_keypair(spec["secret_file"]),
        allow=None if plaintext else AllowList.from_directory(spec["allow_dir"]),
        tamper=lambda key, view: _flip(key, view) if key.startswith(b"flip") else view,
        name="test-server")
    try:
        conn.send(("ready", server.port, list(collect.lines)))
        while True:
            server.poll(0.02)
            if conn.poll():
                try:
                    cmd = conn.recv()
                except EOFError:
                    return
                if cmd == "counters":
                    conn.send(server.counters.as_dict())
                elif cmd == "stop":
                    return
    finally:
        server.close()
