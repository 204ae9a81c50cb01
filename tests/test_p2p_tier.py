"""The p2p tier (shmtier/tiers/p2p/scheduler.py + endpoint.py): engines in separate processes
on 127.0.0.1 with real segments, endpoint processes and CurveZMQ keys.

Each engine runs in a spawned process (tests/p2p_engine.py); every engine, endpoint,
socket, segment and key directory is removed at the end, also when a test fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("zmq")

import p2p_engine  # noqa: E402  (tests/ is on sys.path)
from shmtier.options import ConfigError  # noqa: E402
from shmtier.tiers.p2p.keys import generate_keypair_files  # noqa: E402

CTX = mp.get_context("spawn")
LAYOUT = {"page": 8192, "chunks": 16}


class EngineProc:
    def __init__(self, engine_id: str, tier: dict, layout: dict):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=p2p_engine.serve, args=(child, engine_id, tier, layout),
                                daemon=True)
        self.proc.start()
        child.close()
        self.port = None

    def wait_ready(self, timeout_s: float = 60) -> "EngineProc":
        assert self.conn.poll(timeout_s), "engine process did not start"
        tag, self.port = self.conn.recv()
        assert tag == "ready", tag
        return self

    def call(self, *cmd, timeout_s: float = 60):
        self.conn.send(cmd)
        assert self.conn.poll(timeout_s), f"engine did not answer {cmd[0]}"
        tag, value = self.conn.recv()
        assert tag == "ok", value
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


@pytest.fixture(scope="module")
def keys():
    """Key pairs a, b (allowed by each other) and a stranger; allow dirs per engine."""
    d = tempfile.mkdtemp(prefix="shmtier-p2p-tier-keys-")
    try:
        for name in ("a", "b", "stranger"):
            generate_keypair_files(os.path.join(d, name), name)
        for me, other in (("a", "b"), ("b", "a"), ("stranger", "a")):
            os.makedirs(os.path.join(d, f"allow-{me}"))
            shutil.copy(os.path.join(d, other, f"{other}.key"), os.path.join(d, f"allow-{me}"))
        yield SimpleNamespace(dir=d, **{
            n: {"secret_key_file": os.path.join(d, n, f"{n}.key_secret"),
                "allow_keys_dir": os.path.join(d, f"allow-{n}")}
            for n in ("a", "b", "stranger")})
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def engines(engine_id):
    made: list[EngineProc] = []

    def start(*specs):
        """Start engines (tier options, layout) in parallel; return them once ready."""
        new = [EngineProc(f"{engine_id}-{len(made) + i}", tier, {**LAYOUT, **layout})
               for i, (tier, layout) in enumerate(specs)]
        made.extend(new)
        return [e.wait_ready() for e in new]

    yield start
    for e in made:
        e.close()


def tier(k: dict, **over) -> dict:
    return {"host": "127.0.0.1", "port": 0, "unbound_store_timeout_s": 20,
            "fetch_timeout_s": 3, "lookup_timeout_s": 3, **k, **over}


def pd(kvid: str, port: int) -> dict:
    return {"remote_prefiller": {"kv_request_id": kvid, "remote_host": "127.0.0.1",
                                 "remote_port": port}}


def wait_stats(engine: EngineProc, until, timeout_s: float = 10) -> dict:
    """The engine's stats once ``until(stats)`` (endpoint counters come every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = engine.call("stats")
        if st["counters"] and until(st):
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.1)


# --------------------------------------------------------------------------- PD


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [{}, {"world_size": 2, "bpc": 2, "page": 4096}],
                         ids=["1rank", "2ranks-2bpc"])
def test_pd_byte_exact(engines, keys, layout):
    """The producer parks its request's chunks; the consumer looks them up HIT, the
    promotion fetches them, and the GPU bytes loaded equal the producer's; its
    pins are released once fetched."""
    prod, cons = engines((tier(keys.a), layout), (tier(keys.b), layout))
    ks = list(range(1, 6))
    sent = prod.call("produce", "p1", "kv-1", ks, 0)
    assert all(r is not None and r > 0 for r in prod.call("refs", ks))  # parked: pinned
    got = cons.call("consume", "c1", pd("kv-1", prod.port), ks, 40, 20)
    assert got["answers"][0] == ["HIT_PENDING"] * len(ks)
    assert got["answers"][-1] == ["HIT"] * len(ks)
    assert got["data"] == sent
    assert got["slowest_call_s"] < 0.5
    wait_unpinned(prod, ks)
    st = wait_stats(prod, lambda st: st["counters"]["server"]["chunks"] >= len(ks))
    assert st["parked"] == 0
    assert st["counters"]["server"]["bytes_sent"] == len(sent)


def wait_unpinned(engine: EngineProc, ks: list, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.call("refs", ks) != [0] * len(ks):
        assert time.monotonic() < deadline, engine.call("refs", ks)
        time.sleep(0.05)


# --------------------------------------------------------------------------- symmetric


@pytest.mark.timeout(120)
def test_symmetric_retry_then_hit_and_miss(engines, keys):
    """A consumer with remote_kv_source: RETRY until the peer answers, HIT for the chunks
    the peer holds (fetched byte-exact), MISS for the others; the peer's pins for the
    lookup are released after the fetch; an unknown request id at a peer with nothing
    is all MISS."""
    a, b = engines((tier(keys.a), {}), (tier(keys.b), {}))
    held = [11, 12, 13, 14]
    sent = a.call("produce", "p1", None, held, 0)
    assert a.call("refs", held) == [0] * len(held)
    src = {"remote_kv_source": {"kv_request_id": "sym-1", "remote_host": "127.0.0.1",
                                "remote_port": a.port}}
    got = b.call("consume", "c1", src, held + [15, 16], 40, 20)
    assert got["answers"][0] == ["RETRY"] * 6
    assert got["answers"][-1] == ["HIT"] * 4 + ["MISS"] * 2
    assert got["data"] == sent
    assert got["slowest_call_s"] < 0.5
    wait_unpinned(a, held)
    # the peer was asked through its ParentManager: nothing of this engine's stays pinned
    st = wait_stats(a, lambda st: st["counters"]["server"]["chunks"] >= 4)
    assert st["parked"] == 0 and st["counters"]["server"]["lookups"] >= 1
    got = b.call("consume", "c2", {"remote_kv_source": {**src["remote_kv_source"],
                                                        "kv_request_id": "sym-2"}},
                 [21, 22], 50, 20)
    assert got["answers"][-1] == ["MISS", "MISS"] and got["data"] is None
