"""The p2p tier (shmtier/tiers/p2p/scheduler.py, supervisor.py, endpoint/): engines in separate processes
on 127.0.0.1 with real segments, endpoint processes and CurveZMQ keys.

Each engine runs in a spawned process (tests/p2p_engine.py); every engine, endpoint,
socket, segment and key directory is removed at the end, also when a test fails.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("zmq")

import p2p_engine  # noqa: E402  (tests/ is on sys.path)
from fs_engine import key as chunk_key  # noqa: E402
from shmtier.options import ConfigError  # noqa: E402
from shmtier.shared.segment import segment_name  # noqa: E402
from shmtier.shared.segment_tools import clean_stale_segments  # noqa: E402
from shmtier.shared.jobs import Outcome  # noqa: E402
from shmtier.tiers.p2p.endpoint.client import ChunkClient  # noqa: E402
from shmtier.tiers.p2p.keys import generate_keypair_files, load_keypair, load_public_key  # noqa: E402
from shmtier.tiers.p2p.status import p2p_sessions  # noqa: E402

CTX = mp.get_context("spawn")
LAYOUT = {"page": 8192, "chunks": 16}


class EngineProc:
    def __init__(self, engine_id: str, tier: dict, layout: dict):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=p2p_engine.serve, args=(child, engine_id, tier, layout),
                                daemon=True)
        self.proc.start()
        child.close()
        self.engine_id = engine_id
        self.port = None

    def wait_ready(self, timeout_s: float = 60) -> "EngineProc":
        assert self.conn.poll(timeout_s), "engine process did not start"
        tag, self.port = self.conn.recv()
        assert tag == "ready", tag
        return self

    def call(self, *cmd, timeout_s: float = 60):
        self.send(*cmd)
        return self.result(cmd[0], timeout_s)

    def send(self, *cmd) -> None:
        """Start a command; ``result`` takes its answer (engines work side by side)."""
        self.conn.send(cmd)

    def result(self, what: str = "", timeout_s: float = 60):
        assert self.conn.poll(timeout_s), f"engine did not answer {what}"
        tag, value = self.conn.recv()
        assert tag == "ok", value
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass

    def close(self) -> None:
        self.stop()
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
        pub = {n: load_public_key(os.path.join(d, n, f"{n}.key")).decode()
               for n in ("a", "b", "stranger")}
        yield SimpleNamespace(dir=d, pub=pub, **{
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
    for e in made:  # all at once: each takes a moment to shut its endpoint down
        e.stop()
    for e in made:
        e.close()
    # an engine that did not stop in time was killed: its segment is stale now (only
    # these engines' segments: /dev/shm is host-wide, other suites keep stale ones on purpose)
    clean_stale_segments({segment_name(e.engine_id) for e in made})


def tier(k: dict, **over) -> dict:
    return {"host": "127.0.0.1", "port": 0, "unbound_store_timeout_s": 20,
            "fetch_timeout_s": 3, "lookup_timeout_s": 3, **k, **over}


def pd(kvid: str, port: int) -> dict:
    return {"remote_prefiller": {"kv_request_id": kvid, "remote_host": "127.0.0.1",
                                 "remote_port": port}}


def metric(st: dict, name: str) -> float:
    """A tier counter (short name: after ``p2p_``) summed over its labels."""
    return sum(st["metrics"].get(name, {}).values())


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
    # per-peer series, labelled with the other engine's "host:port"
    st = wait_stats(prod, lambda st: metric(st, "served_bytes") == len(sent))
    assert st["metrics"]["served_bytes"] == {f"1:p2p,127.0.0.1:{cons.port}": len(sent)}
    st = wait_stats(cons, lambda st: metric(st, "fetched_bytes") == len(sent))
    assert st["metrics"]["fetched_bytes"] == {f"1:p2p,127.0.0.1:{prod.port}": len(sent)}
    assert set(st["metrics"]["fetch_seconds"]) == {f"1:p2p,127.0.0.1:{prod.port}"}
    # the sessions as the CLI can read them (status.json of each endpoint)
    (ps,) = wait_sessions(prod.engine_id, lambda s: s["inbound"] and s["inbound"][0]["bytes_sent"])
    assert ps["endpoint"] == f"127.0.0.1:{prod.port}" and ps["alive"] and ps["parked"]["rows"] == 0
    assert [(i["name"], i["refused"], i["bytes_sent"]) for i in ps["inbound"]] == [
        (f"127.0.0.1:{cons.port}", "", len(sent))]
    assert ps["inbound"][0]["key"] == keys.pub["b"] and ps["outbound"] == []
    (cs,) = wait_sessions(cons.engine_id, lambda s: s["outbound"] and s["outbound"][0]["chunks"])
    (out,) = cs["outbound"]
    assert out["peer"] == f"127.0.0.1:{prod.port}" and out["circuit"] == "closed"
    assert out["chunks"] == len(ks) and out["bytes_received"] == len(sent)
    # and in `shmtier top`
    got = subprocess.run([sys.executable, "-m", "shmtier", "top", cons.engine_id, "--once",
                          "--json", "--interval", "0.05"], capture_output=True, text=True,
                         timeout=60)
    assert got.returncode == 0, got.stderr
    (top_p2p,) = json.loads(got.stdout)["p2p"]
    assert top_p2p["outbound"][0]["peer"] == f"127.0.0.1:{prod.port}"
    got = subprocess.run([sys.executable, "-m", "shmtier", "top", prod.engine_id, "--once",
                          "--interval", "0.05"], capture_output=True, text=True, timeout=60)
    assert f"p2p    endpoint 127.0.0.1:{prod.port}" in got.stdout, got.stdout + got.stderr
    assert f"in  127.0.0.1:{cons.port}" in got.stdout


@pytest.mark.timeout(120)
def test_a_request_loaded_in_two_jobs_gets_both_parts(engines, keys):
    """The manager may promote a request's keys in several jobs (one step's lookups, then
    the next's). The first load's end releases only the chunks it fetched at the
    producer: the second load of the same request still finds the rest parked (before,
    the whole request was released and the second load missed)."""
    prod, cons = engines((tier(keys.a), {}), (tier(keys.b), {}))
    ks = list(range(1, 7))
    sent = prod.call("produce", "p1", "kv-parts", ks, 0)
    got = cons.call("consume_in_parts", "c1", pd("kv-parts", prod.port), ks, 40, 2, 20)
    firsts = [a for a in got["answers"] if len(a) == 2]
    assert firsts[0] == ["HIT_PENDING"] * 2 and firsts[-1] == ["HIT"] * 2
    assert got["answers"][-1] == ["HIT"] * len(ks)  # the second job loaded the rest
    assert got["data"] == sent
    wait_unpinned(prod, ks)
    st = wait_stats(prod, lambda st: st["counters"]["server"]["chunks"] >= len(ks))
    assert st["parked"] == 0 and st["counters"]["server"]["chunks"] == len(ks)


def wait_sessions(engine_id: str, until, timeout_s: float = 10) -> list:
    """``p2p_sessions(engine_id)`` once ``until(status)`` holds for its one status."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = p2p_sessions(engine_id)
        if len(got) == 1 and until(got[0]):
            return got
        assert time.monotonic() < deadline, got
        time.sleep(0.1)


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
    wait_unpinned(a, held)  # no producer role: its cascades succeed at once, unpinned
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


@pytest.mark.timeout(120)
def test_a_key_the_producer_never_stores_misses_at_once(engines, keys):
    """The producer's request finishes without storing some of the keys the consumer
    asks for: its endpoint answers their misses final, so the consumer's fetch round
    ends at once (MISS, well under fetch_timeout_s = 10 s) instead of waiting it out:
    for a round started after the producer finished, and for one already waiting
    when it finished. The chunks stored are exact; the producer's pins are released."""
    prod, cons = engines((tier(keys.a), {}), (tier(keys.b, fetch_timeout_s=10), {}))
    ks = [111, 112, 113, 114]
    sent = prod.call("produce", "p1", "kv-c1", ks[:2], 0)  # 113, 114 never stored
    t0 = time.monotonic()
    got = cons.call("consume", "c1", pd("kv-c1", prod.port), ks, 40, 30)
    assert time.monotonic() - t0 < 3.0
    assert got["answers"][-1] == ["HIT"] * 2 + ["MISS"] * 2 and got["data"] == sent
    # pending: the round waits for 122 and 123; the producer stores 122, then finishes
    sent = prod.call("produce", "p2", "kv-c2", [121], 4, False)
    cons.send("consume", "c2", pd("kv-c2", prod.port), [121, 122, 123], 50, 30)
    time.sleep(1.0)
    sent += prod.call("produce_more", "p2", [122], 5)
    t1 = time.monotonic()
    prod.call("finish", "p2")
    got = cons.result("consume", 30)
    assert time.monotonic() - t1 < 3.0
    assert got["answers"][-1] == ["HIT"] * 2 + ["MISS"] and got["data"] == sent
    wait_unpinned(prod, ks[:2] + [121, 122])
    assert cons.call("refs", [113, 114, 123]) == [None] * 3


@pytest.mark.timeout(180)
@pytest.mark.parametrize("security", ["curve", "plaintext"])
def test_parked_rows_are_served_only_to_the_consumer_they_are_for(engines, keys, security):
    """Three engines: the producer admits both others, and parks a PD request whose
    remote_decoder names one of them (host, port and, with CurveZMQ, its public key).
    The other admitted engine asks for that request id: refused and counted (its fetch
    and its done), nothing served, the rows stay parked; the named consumer then gets
    the bytes exactly and the pins are released."""
    if security == "curve":
        both = {"secret_key_file": keys.a["secret_key_file"],
                "allow_keys": [keys.pub["b"], keys.pub["stranger"]]}
        prod, cons, third = engines((tier(both), {}), (tier(keys.b), {}),
                                    (tier(keys.stranger), {}))
    else:
        prod, cons, third = engines(*[(tier({}, plaintext=True), {})] * 3)
    to = {"kv_request_id": "kv-bound", "remote_host": "127.0.0.1", "remote_port": cons.port}
    if security == "curve":
        to["remote_public_key"] = keys.pub["b"]
    ks = [131, 132, 133]
    sent = prod.call("produce", "p1", to, ks, 0)
    got = third.call("consume", "c1", pd("kv-bound", prod.port), ks, 40, 20)
    assert got["answers"][-1] == ["MISS"] * 3 and got["data"] is None
    st = wait_stats(prod, lambda st: st["counters"]["server"]["refused_requests"] >= 2)
    server = st["counters"]["server"]
    assert server["chunks"] == 0 and server["bytes_sent"] == 0
    assert st["parked"] == 3 and all(r > 0 for r in prod.call("refs", ks))
    st = wait_stats(prod, lambda st: metric(st, "refused_requests") >= 2)
    assert set(st["metrics"]["refused_requests"]) == {"1:p2p,inbound"}
    got = cons.call("consume", "c2", pd("kv-bound", prod.port), ks, 50, 20)
    assert got["answers"][-1] == ["HIT"] * 3 and got["data"] == sent
    wait_unpinned(prod, ks)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("security", ["curve", "plaintext"])
def test_rows_parked_for_a_symmetric_lookup_are_served_only_to_the_peer_that_asked(
        engines, keys, security):
    """Engine A holds chunks in its CPU tier (no role); consumer B (remote_kv_source
    naming A) looks them up: A parks its hits for B's request, bound to B's session.
    B holds the request there (looked up once, not promoted), and a third admitted
    peer C (a real ChunkClient with its own identity in A's allow-list) asks A for the
    same request id: its fetch, lookup and done are refused and counted at A (peer
    "inbound"), nothing is served, the rows stay parked; B then loads the chunks
    byte-exact and A's pins are released."""
    if security == "curve":
        both = {"secret_key_file": keys.a["secret_key_file"],
                "allow_keys": [keys.pub["b"], keys.pub["stranger"]]}
        a, b = engines((tier(both), {}), (tier(keys.b), {}))
    else:
        a, b = engines(*[(tier({}, plaintext=True), {})] * 2)
    held = [141, 142, 143]
    sent = a.call("produce", "p1", None, held, 0)
    wait_unpinned(a, held)  # no role: its cascades succeed at once, nothing parked
    # B looks the request up once and waits for A's answer, without looking up again:
    # its promotion (the fetch, then "done" at A) has not started
    got = b.call("look", "c1", src("sym-bound", a.port), held + [144], 40, 20)
    assert got == {"first": ["RETRY"] * 4, "peer": [True] * 3 + [False]}
    # A answered: its rows for sym-bound are parked (pinned), bound to B's session
    assert a.call("stats")["parked"] == 3 and all(r > 0 for r in a.call("refs", held))
    ast = a.call("stats")
    ident = ({"keys": load_keypair(keys.stranger["secret_key_file"]),
              "server_key": keys.pub["a"]} if security == "curve" else {"plaintext": True})
    size = len(sent) // len(held)
    with ChunkClient("127.0.0.1", a.port, fingerprint=ast["fingerprint"],
                     hash_seed=ast["hash_seed"], name="127.0.0.1:1", **ident) as c:
        rows = [bytearray(size) for _ in held]
        res = c.fetch([chunk_key(k) for k in held], rows, 5.0, "sym-bound")
        assert res.outcomes == [Outcome.ERROR] * 3, res
        assert all("not_bound" in d for d in res.details), res.details
        assert rows == [bytearray(size)] * 3  # nothing written
        assert c.lookup([chunk_key(k) for k in held], 5.0, "sym-bound") == [False] * 3
        assert c.done("sym-bound", 1.0)
        # an unbound request of A answers C as usual: C's session itself is admitted
        assert c.lookup([chunk_key(145)], 5.0, "sym-other") == [False]
    st = wait_stats(a, lambda st: st["counters"]["server"]["refused_requests"] >= 3)
    server = st["counters"]["server"]
    assert server["refused_requests"] == 3  # fetch, lookup, done
    assert server["chunks"] == 0 and server["bytes_sent"] == 0
    assert st["parked"] == 3 and all(r > 0 for r in a.call("refs", held))
    st = wait_stats(a, lambda st: metric(st, "refused_requests") >= 3)
    assert st["metrics"]["refused_requests"] == {"1:p2p,inbound": 3}
    got = b.call("resume", "c1", 20)
    assert got["answers"][-1] == ["HIT"] * 3 + ["MISS"] and got["data"] == sent
    wait_unpinned(a, held)
    st = wait_stats(a, lambda st: st["counters"]["server"]["chunks"] >= 3)
    assert st["parked"] == 0 and st["counters"]["server"]["bytes_sent"] == len(sent)


def raw_fetch(port: int, client_keys, server_key: str, name: str, fingerprint: str,
              hash_seed, req: str, ks: list, timeout_s: float = 10.0) -> dict:
    """A raw pyzmq DEALER (not ChunkClient) with ``client_keys``'s CurveZMQ identity says
    hello as ``name`` to the endpoint at ``port`` and fetches ``ks`` of request ``req``.
    Returns ``{"hello": the hello answer's type, "status": [st per key], "data": [the
    payload frames received]}``."""
    import zmq

    from shmtier.tiers.p2p.endpoint import wire
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_secretkey = client_keys.secret
    sock.curve_publickey = client_keys.public
    sock.curve_serverkey = server_key.encode()
    sock.rcvtimeo = int(timeout_s * 1000)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(wire.pack({"t": "hello", "v": wire.PROTOCOL_VERSION, "fp": fingerprint,
                             "seed": hash_seed, "name": name}))
        hello = wire.unpack(sock.recv())
        out = {"hello": hello["t"], "status": [None] * len(ks), "data": []}
        if hello["t"] != "hello_ok":
            return out
        sock.send(wire.pack({"t": "fetch", "rid": 7, "req": req,
                             "keys": [chunk_key(k) for k in ks]}))
        while None in out["status"]:
            frames = sock.recv_multipart()
            head = wire.unpack(frames[0])
            assert head["t"] == "chunk" and head["rid"] == 7, head
            out["status"][head["i"]] = head["st"]
            out["data"].extend(bytes(f) for f in frames[1:])
        return out
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(240)
def test_an_admitted_peer_that_claims_the_consumers_name_is_served_nothing(engines, keys, capfd):
    """Issue 28 (1). Three engines: the producer admits two keys (the consumer's and a
    stranger's) and has no ``peers`` entry. A PD request bound to the consumer by
    host:port only (no ``remote_public_key``): the producer cannot know the consumer's
    key, and a hello's name proves nothing, so it parks nothing for it (it said so at
    start, and says why when the request comes, counted as refused for that peer). A raw
    pyzmq client holding the admitted stranger key says hello as the consumer
    ("127.0.0.1:<consumer port>") and fetches: refused, no byte served. The same request
    with the consumer's ``remote_public_key``: the spoofing client is refused again
    (bound to the other key), the stranger engine too, and the rightful consumer gets
    its chunks byte-exact."""
    both = {"secret_key_file": keys.a["secret_key_file"],
            "allow_keys": [keys.pub["b"], keys.pub["stranger"]]}
    prod, cons, stranger = engines((tier(both), {}), (tier(keys.b), {}),
                                   (tier(keys.stranger), {}))
    started = capfd.readouterr().err  # what the engines logged at start
    pst = prod.call("stats")
    spoof = dict(client_keys=load_keypair(keys.stranger["secret_key_file"]),
                 server_key=keys.pub["a"], name=f"127.0.0.1:{cons.port}",
                 fingerprint=pst["fingerprint"], hash_seed=pst["hash_seed"])
    # 1. bound by name only: nothing is parked for it, nobody is served
    ks = [151, 152, 153]
    by_name = {"kv_request_id": "kv-claimed", "remote_host": "127.0.0.1",
               "remote_port": cons.port}
    prod.call("produce", "p1", by_name, ks, 0)
    got = raw_fetch(prod.port, req="kv-claimed", ks=ks, **spoof)
    assert got["hello"] == "hello_ok"  # an admitted key: its session is fine
    assert "ok" not in got["status"] and got["data"] == [], got["status"]
    assert prod.call("refs", ks) == [0] * 3  # not parked: not pinned
    assert "remote_public_key" in started and "no peers entry" in started, started
    err = capfd.readouterr().err
    assert f"127.0.0.1:{cons.port}" in err and "not parked" in err, err
    st = wait_stats(prod, lambda st: metric(st, "refused_handshakes") >= 1)
    assert st["metrics"]["refused_handshakes"] == {f"1:p2p,127.0.0.1:{cons.port}": 1}
    assert st["parked"] == 0
    got = cons.call("consume", "c1", pd("kv-claimed", prod.port), ks, 40, 20)
    assert got["answers"][-1] == ["MISS"] * 3 and got["data"] is None
    # 2. bound to the consumer's key: the spoof is refused, the consumer is served
    ks = [154, 155, 156]
    by_key = {**by_name, "kv_request_id": "kv-keyed", "remote_public_key": keys.pub["b"]}
    sent = prod.call("produce", "p2", by_key, ks, 4)
    # The binding reaches the endpoint with the parking, a message after the step: a fetch
    # before it finds nothing there yet (a miss, nothing served; it raced so once in CI)
    deadline = time.monotonic() + 10
    while True:
        got = raw_fetch(prod.port, req="kv-keyed", ks=ks, **spoof)
        assert got["data"] == [], got
        if got["status"] != ["miss"] * 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got["status"] == ["refused"] * 3, got
    got = stranger.call("consume", "c2", pd("kv-keyed", prod.port), ks, 40, 20)
    assert got["answers"][-1] == ["MISS"] * 3 and got["data"] is None
    st = wait_stats(prod, lambda st: st["counters"]["server"]["refused_requests"] >= 2)
    server = st["counters"]["server"]
    assert server["chunks"] == 0 and server["bytes_sent"] == 0
    assert st["parked"] == 3 and all(r > 0 for r in prod.call("refs", ks))
    got = cons.call("consume", "c3", pd("kv-keyed", prod.port), ks, 50, 20)
    assert got["answers"][-1] == ["HIT"] * 3 and got["data"] == sent
    wait_unpinned(prod, ks)
    st = wait_stats(prod, lambda st: st["counters"]["server"]["chunks"] >= 3)
    assert st["counters"]["server"]["bytes_sent"] == len(sent)


# --------------------------------------------------------------------------- failures


@pytest.mark.timeout(120)
def test_wrong_key_unknown_peer_other_layout_and_hash_seed_are_refused(engines, keys):
    """A peer whose key the producer does not allow is refused at the handshake, one
    with another layout or another hash seed at the hello (all counted at the producer,
    the seed also in both tiers' refused metric); a consumer that does not know the
    producer's key does not connect at all. Nothing is served: the consumers' lookups
    end MISS and the producer's parked chunks stay pinned for the rightful consumer."""
    two_keys = {"secret_key_file": keys.b["secret_key_file"],
                "allow_keys": [keys.pub["a"], keys.pub["stranger"]]}
    a, stranger, other, seeded = engines(
        (tier(keys.a, hash_seed="seed-1"), {}), (tier(keys.stranger, hash_seed="seed-1"), {}),
        (tier(two_keys, hash_seed="seed-1"), {"page": 4096}),
        (tier(keys.b, hash_seed="seed-2"), {}))
    ks = [31, 32, 33]
    a.call("produce", "p1", "kv-x", ks, 0)
    got = stranger.call("consume", "c1", pd("kv-x", a.port), ks, 40, 20)
    assert got["answers"][-1] == ["MISS"] * 3 and got["data"] is None
    got = other.call("consume", "c2", pd("kv-x", a.port), ks, 40, 20)  # no key for a
    assert got["answers"][-1] == ["MISS"] * 3 and got["data"] is None
    with_key = pd("kv-x", a.port)
    with_key["remote_prefiller"]["remote_public_key"] = keys.pub["a"]
    got = other.call("consume", "c3", with_key, ks, 40, 20)
    assert got["answers"][-1] == ["MISS"] * 3 and got["data"] is None
    got = seeded.call("consume", "c4", pd("kv-x", a.port), ks, 40, 20)
    assert got["answers"][-1] == ["MISS"] * 3 and got["data"] is None
    st = wait_stats(a, lambda st: {"unknown_key", "fingerprint", "hash_seed"}
                    <= set(st["counters"]["server"]["refused_handshakes"]))
    server = st["counters"]["server"]
    assert server["chunks"] == 0 and server["bytes_sent"] == 0 and server["requests"] == 0
    assert st["parked"] == 3 and all(r > 0 for r in a.call("refs", ks))
    assert st["metrics"]["refused_handshakes"]["1:p2p,inbound"] >= 3  # key, layout, seed
    st = wait_stats(seeded, lambda st: metric(st, "refused_handshakes") >= 1)
    assert set(st["metrics"]["refused_handshakes"]) == {f"1:p2p,127.0.0.1:{a.port}"}
    (client,) = st["counters"]["clients"].values()
    assert set(client["refused_handshakes"]) == {"hash_seed"} and client["chunks"] == 0


@pytest.mark.timeout(120)
def test_pd_requests_side_by_side_are_fetched_together_byte_exact(engines, keys):
    """Four PD requests from one producer arrive in the same step: their loads reach the
    consumer's endpoint together and go as one pipelined round (one fetch request per
    load on the one connection). Each lands byte-exact in its own rows; one whose
    producer request finished without its third chunk gets that chunk as a final MISS
    (at once, not after fetch_timeout_s) while its first two and the other requests load."""
    prod, cons = engines((tier(keys.a), {}), (tier(keys.b, fetch_timeout_s=10), {}))
    groups = [[61, 62, 63], [64, 65, 66], [67, 68, 69], [70, 71]]
    sent = [prod.call("produce", f"p{i}", f"kv-m{i}", ks, 4 * i)
            for i, ks in enumerate(groups)]
    asked = groups[:3] + [groups[3] + [72]]  # 72: never stored by the finished request
    got = cons.call("consume_many", [(f"c{i}", pd(f"kv-m{i}", prod.port), ks, 40 + 4 * i)
                                     for i, ks in enumerate(asked)], 30)
    for i, r in enumerate(got["requests"]):
        want = ["HIT"] * len(groups[i]) + (["MISS"] if i == 3 else [])
        assert r["answers"][-1] == want, (i, r["answers"])
        assert r["data"] == sent[i], i
        assert r["done_s"] < 5.0, (i, r["done_s"])  # the final miss did not wait 10 s
    assert got["slowest_call_s"] < 0.5
    for ks in groups:
        wait_unpinned(prod, ks)
    assert cons.call("refs", [72]) == [None]


@pytest.mark.timeout(120)
def test_producer_killed_mid_transfer(engines, keys):
    """The producer (engine and endpoint) is SIGKILLed while the consumer's fetch round
    waits for chunks it has not parked yet: the load fails cleanly (the chunks that
    arrived are exact, the rest are freed), later lookups of the request and of a new
    one MISS, and the consumer keeps running with nothing pinned. The producer's socket
    directory, which neither it nor its endpoint could remove, is removed by its segment
    guardian (as when vLLM SIGKILLs an EngineCore's process tree)."""
    prod, cons = engines((tier(keys.a), {}), (tier(keys.b, fetch_timeout_s=4), {}))
    ks = [41, 42, 43, 44, 45, 46]
    sent = prod.call("produce", "p1", "kv-k", ks[:3], 0, False)  # more to come: not finished
    st = prod.call("stats")
    endpoint = st["pid"]
    cons.conn.send(("consume", "c1", pd("kv-k", prod.port), ks, 40, 20))
    time.sleep(1.0)  # the round has the first 3 and asks again for the rest
    for pid in (endpoint, prod.proc.pid):
        os.kill(pid, signal.SIGKILL)
    prod.proc.join(5)
    try:
        assert cons.conn.poll(30)
        tag, got = cons.conn.recv()
        assert tag == "ok", got
        assert got["answers"][-1] == ["HIT"] * 3 + ["MISS"] * 3
        assert got["data"] == sent
        assert got["slowest_call_s"] < 0.5
        assert cons.call("refs", ks) == [0, 0, 0, None, None, None]
        later = cons.call("consume", "c2", pd("kv-k2", prod.port), [51, 52], 50, 20)
        assert later["answers"][-1] == ["MISS", "MISS"] and later["data"] is None
        assert cons.call("refs", [51, 52]) == [None, None]
        deadline = time.monotonic() + 10
        while os.path.exists(st["tmpdir"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(st["tmpdir"]), os.listdir(st["tmpdir"])
    finally:
        deadline = time.monotonic() + 5
        while _alive(endpoint) and time.monotonic() < deadline:  # may still be exiting
            time.sleep(0.05)
        clean_stale_segments({segment_name(prod.engine_id)})
        shutil.rmtree(st["tmpdir"], ignore_errors=True)


@pytest.mark.timeout(120)
def test_unfetched_parked_chunks_are_released_after_the_timeout(engines, keys):
    """No consumer ever fetches: the producer's parked pins are released within
    unbound_store_timeout_s, and a later store of the same request fails at once
    instead of parking again."""
    (prod,) = engines((tier(keys.a, unbound_store_timeout_s=1.0), {}))
    ks = [61, 62, 63]
    t0 = time.monotonic()
    prod.call("produce", "p1", "kv-gone", ks, 0)
    assert all(r > 0 for r in prod.call("refs", ks))
    wait_unpinned(prod, ks, timeout_s=5)
    assert time.monotonic() - t0 < 3.0
    prod.call("produce", "p2", "kv-gone", [64], 10)
    wait_unpinned(prod, [64], timeout_s=2)  # its store fails at once (the id timed out)
    assert prod.call("stats")["parked"] == 0


@pytest.mark.timeout(120)
def test_endpoint_restarts_and_releases_parked_pins(engines, keys):
    """The producer's endpoint process dies: its parked stores fail (unpinned at once),
    a new endpoint starts on the same port and serves the next request."""
    prod, cons = engines((tier(keys.a), {}), (tier(keys.b), {}))
    ks = [71, 72]
    prod.call("produce", "p1", "kv-r1", ks, 0)
    st = prod.call("stats")
    os.kill(st["pid"], signal.SIGKILL)
    wait_unpinned(prod, ks)
    deadline = time.monotonic() + 20
    while True:
        new = prod.call("stats")
        if new["restarts"] == 1 and new["pid"] not in (None, st["pid"]) and new["counters"]:
            break
        assert time.monotonic() < deadline, new
        time.sleep(0.1)
    time.sleep(0.3)  # the new endpoint binds the port
    sent = prod.call("produce", "p2", "kv-r2", [73, 74], 4)
    got = cons.call("consume", "c1", pd("kv-r2", prod.port), [73, 74], 40, 20)
    assert got["data"] == sent


# --------------------------------------------------------------------------- three engines


def src(kvid: str, port: int) -> dict:
    return {"remote_kv_source": {"kv_request_id": kvid, "remote_host": "127.0.0.1",
                                 "remote_port": port}}


def free_port_base(dp: int) -> int:
    """A port ``base`` such that ``base + dp`` is free now (for a configured port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert port - dp >= 1024
    return port - dp


@pytest.mark.timeout(180)
def test_one_producer_serves_two_consumers_at_once(engines, keys):
    """Three engines: one producer parks a PD request and holds other chunks; one
    consumer fetches the PD request while the other looks up and fetches the held
    chunks symmetrically, at the same time. Both get the producer's bytes exactly, and
    the producer's pins are released once both are done. The producer is data-parallel
    rank 2 with ``port`` = base: it listens on base + 2 (vLLM's rule)."""
    layout = {"world_size": 2, "page": 4096}
    base = free_port_base(2)
    prod, c1, c2 = engines((tier(keys.a, port=base), {**layout, "data_parallel_index": 2}),
                           (tier(keys.b), layout), (tier(keys.b), layout))
    assert prod.port == base + 2
    parked, held = [81, 82, 83, 84], [85, 86, 87]
    sent_pd = prod.call("produce", "p1", "kv-3a", parked, 0)
    sent_sym = prod.call("produce", "p2", None, held, 10)
    c1.send("consume", "c1", pd("kv-3a", prod.port), parked, 40, 30)
    c2.send("consume", "c2", src("sym-3b", prod.port), held + [88], 50, 30)
    got1, got2 = c1.result("consume"), c2.result("consume")
    assert got1["answers"][-1] == ["HIT"] * 4 and got1["data"] == sent_pd
    assert got2["answers"][-1] == ["HIT"] * 3 + ["MISS"] and got2["data"] == sent_sym
    assert max(got1["slowest_call_s"], got2["slowest_call_s"]) < 0.5
    wait_unpinned(prod, parked + held)
    st = wait_stats(prod, lambda st: st["counters"]["server"]["chunks"] >= 7)
    assert st["parked"] == 0
    assert st["counters"]["server"]["bytes_sent"] == len(sent_pd) + len(sent_sym)
    assert st["counters"]["server"]["handshakes"] == 2


@pytest.mark.timeout(180)
def test_a_stalled_peer_slows_only_its_own_requests(engines, keys):
    """The consumer fetches from two producers at once while one producer's endpoint is
    stopped (SIGSTOP): the other producer's request completes as usual, the consumer's
    scheduler calls stay fast, the stalled request fails by fetch_timeout_s (its rows
    freed, nothing pinned). After SIGCONT the same producer serves a new request."""
    p1, p2, cons = engines((tier(keys.a), {}), (tier(keys.a), {}),
                           (tier(keys.b, fetch_timeout_s=4), {}))
    ks1, ks2 = [91, 92, 93], [94, 95, 96]
    p1.call("produce", "a1", "kv-s1", ks1, 0)
    sent2 = p2.call("produce", "b1", "kv-s2", ks2, 10)
    stopped = p1.call("stats")["pid"]
    os.kill(stopped, signal.SIGSTOP)
    try:
        got = cons.call("consume_many", [("c1", pd("kv-s1", p1.port), ks1, 40),
                                         ("c2", pd("kv-s2", p2.port), ks2, 50)], 30)
    finally:
        os.kill(stopped, signal.SIGCONT)
    r1, r2 = got["requests"]
    assert r2["answers"][-1] == ["HIT"] * 3 and r2["data"] == sent2
    assert r2["done_s"] < 3.0, r2["done_s"]  # unstalled: normally ~0.1 s
    assert r1["answers"][-1] == ["MISS"] * 3 and r1["data"] is None
    assert r1["done_s"] is not None and r1["done_s"] > r2["done_s"]
    assert got["slowest_call_s"] < 0.5
    assert cons.call("refs", ks1) == [None] * 3  # the rows reserved for it were freed
    assert cons.call("refs", ks2) == [0] * 3
    # the stalled producer works again (its circuit at the consumer allows a trial)
    sent3 = p1.call("produce", "a2", "kv-s3", [97, 98], 20)
    deadline = time.monotonic() + 20
    while True:
        again = cons.call("consume", "c3", pd("kv-s3", p1.port), [97, 98], 60, 20)
        if again["data"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # the circuit was still open: fail fast, try again
    assert again["data"] == sent3


@pytest.mark.timeout(180)
def test_consumer_killed_mid_request_releases_the_producers_pins(engines, keys):
    """The consumer's engine is SIGKILLed while its fetch round waits for chunks the
    producer has not parked yet: the producer's parked pins are released within
    unbound_store_timeout_s (counted), its endpoint keeps running, and the consumer's
    endpoint notices its engine is gone, exits and removes its socket directory."""
    prod, cons = engines((tier(keys.a, unbound_store_timeout_s=2.0), {}),
                         (tier(keys.b, fetch_timeout_s=20), {}))
    ks = [101, 102, 103, 104, 105]
    t_parked = time.monotonic()
    prod.call("produce", "p1", "kv-ck", ks[:3], 0, False)  # more to come: not finished
    cst = cons.call("stats")
    cons.send("consume", "c1", pd("kv-ck", prod.port), ks, 40, 30)
    wait_stats(prod, lambda st: st["counters"]["server"]["chunks"] >= 3)  # mid-request
    os.kill(cons.proc.pid, signal.SIGKILL)
    cons.proc.join(5)
    try:
        wait_unpinned(prod, ks[:3], timeout_s=15)
        assert time.monotonic() - t_parked < 2.0 + 6.0
        st = wait_stats(prod, lambda st: metric(st, "unbound_store_timeouts") >= 1)
        assert st["parked"] == 0 and st["restarts"] == 0 and st["pid"] is not None
        deadline = time.monotonic() + 15  # the orphaned endpoint checks its owner each second
        while os.path.exists(cst["tmpdir"]) or _alive(cst["pid"]):
            assert time.monotonic() < deadline, "the consumer's endpoint did not exit"
            time.sleep(0.1)
    finally:
        deadline = time.monotonic() + 5
        while _alive(cst["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(cst["pid"]):
            os.kill(cst["pid"], signal.SIGKILL)
        clean_stale_segments({segment_name(cons.engine_id)})
        shutil.rmtree(cst["tmpdir"], ignore_errors=True)


def _alive(pid: int) -> bool:
    """The process runs (an exited one not yet reaped, a zombie, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def test_poll_fds_is_the_endpoint_socket_and_the_next_off_thread_poll_reads_it(engine_id):
    """``poll_fds``: the endpoint socket's FD (edge-triggered: cleared only by reading
    EVENTS) is readable once the endpoint sent something, and the first off-thread poll
    after ``poll_fds`` reads it although READ_GAP_S would skip the look (else the
    tier-poll thread it woke would leave it readable and wait out its interval). The
    engine runs in this process (its own tier-poll thread stopped: this test plays that
    thread)."""
    import select
    import threading

    import fs_engine

    engine = fs_engine.Engine(engine_id, None, tier_type="p2p", **LAYOUT,
                              **tier({"plaintext": True}))
    try:
        m, p2p = engine.manager, engine.manager.tiers[0]
        assert m._poll_thread.stop()

        def readable(fd: int) -> bool:
            return bool(select.select([fd], [], [], 0)[0])

        def off_thread(fn):
            out = []
            t = threading.Thread(target=lambda: out.append(fn()))
            t.start()
            t.join(10)
            return out[0]

        with m.lock:
            m.on_schedule_end(fs_engine.END)  # this thread steps: the others are off-thread
            fds = p2p.poll_fds()
        assert fds == (p2p.endpoint._sock.getsockopt(p2p.endpoint._zmq.FD),)
        deadline = time.monotonic() + 30
        while not readable(fds[0]):  # the endpoint's "ready"
            assert time.monotonic() < deadline, "the endpoint never sent ready"
            time.sleep(0.01)
        with m.lock:
            assert not p2p.endpoint.ready
            assert off_thread(p2p.poll_fds) == fds
            p2p.endpoint._read_at = time.monotonic() + 60  # as if just looked: READ_GAP_S applies
            off_thread(lambda: p2p.get_finished_jobs())
            assert p2p.endpoint.ready and not readable(fds[0])
            p2p.endpoint._read_at = time.monotonic() + 60
            p2p.get_finished_jobs()  # READ_GAP_S applies again: no look, no error
    finally:
        engine.close()
    assert p2p.poll_fds() == ()  # shut down: nothing to wait on


# --------------------------------------------------------------------------- deferred release


class _StoppedEndpoint:
    """An engine in this process (its tier-poll thread stopped: the test polls) whose p2p
    endpoint is SIGSTOPped while a promotion from a peer is in flight: the endpoint never
    answers, so the scheduler half kills it at the load's deadline (fetch_timeout_s +
    WATCHDOG_EXTRA_S, shortened here)."""

    def __init__(self, engine_id: str, monkeypatch):
        import fs_engine
        from shmtier.tiers.p2p import scheduler as p2p_scheduler

        monkeypatch.setattr(p2p_scheduler, "WATCHDOG_EXTRA_S", 1.0)
        self.end = fs_engine.END
        self.engine = fs_engine.Engine(engine_id, None, tier_type="p2p", **LAYOUT,
                                       **tier({"plaintext": True}, fetch_timeout_s=0.5))
        self.m = self.engine.manager
        self.p2p, self.primary = self.m.tiers[0], self.m.primary
        self.proc = None
        assert self.m._poll_thread.stop()
        self.until(lambda: self.p2p.endpoint.ready, "the endpoint never became ready")

    def step(self) -> None:
        with self.m.lock:
            self.m.on_schedule_end(self.end)

    def until(self, done, what: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            self.step()
            assert time.monotonic() < deadline, what
            time.sleep(0.005)

    def promote_with_endpoint_stopped(self, keys) -> tuple:
        """SIGSTOP the endpoint and promote ``keys`` from a peer (it need not exist: the
        stopped endpoint never gets to it); returns (request, the rows reserved)."""
        from shmtier.contract import LookupResult, ReqContext

        self.proc = self.p2p.endpoint.proc
        self.proc.send_signal(signal.SIGSTOP)
        ctx = ReqContext(f"c-{self.proc.pid}", pd("kv-stopped", 9))
        with self.m.lock:
            self.m.on_new_request(ctx)
            answers = [self.m.lookup(k, ctx) for k in keys]
            assert answers == [LookupResult.HIT_PENDING] * len(keys)
            self.m.on_schedule_end(self.end)  # the load goes to the stopped endpoint
        resident = self.primary.resident_keys()
        return ctx, sorted(resident[k] for k in keys)

    def record_results(self) -> list:
        """Every JobResult the tier reports from now on (a list that fills up)."""
        results, real = [], self.p2p.get_finished_jobs

        def recorded():
            got = list(real())
            results.extend(got)
            return got

        self.p2p.get_finished_jobs = recorded
        return results

    def free_rows(self) -> set:
        from shmtier.shared.chunk_table import NUM_ALLOCATED

        p = self.primary
        return set(p._free_list) | set(range(p._counters[NUM_ALLOCATED], p._num_chunks))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.engine.close()


@pytest.fixture
def stopped_endpoint(engine_id, monkeypatch):
    made = []

    def make():
        made.append(_StoppedEndpoint(engine_id, monkeypatch))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.mark.timeout(120)
def test_a_promotion_failed_while_the_endpoint_may_still_receive_holds_its_rows(
        stopped_endpoint):
    """The stopped endpoint is killed at the load's deadline: the promotion fails at once
    (its keys MISS), but its rows stay out of the free pool (gauge) while the killed
    process is not reaped -- until then it could still write them -- and return at the
    poll that reaps it (the hold observed). Then a new endpoint starts."""
    from shmtier import metrics
    from shmtier.contract import LookupResult

    e = stopped_endpoint()
    m, primary, label = e.m, e.primary, ("1:p2p",)
    keys = [chunk_key(i) for i in (1, 2, 3)]
    ctx, rows = e.promote_with_endpoint_stopped(keys)
    results = e.record_results()
    old_pid = e.proc.pid
    e.until(lambda: primary.num_deferred_release_chunks, "the promotion never failed")
    [failed] = results
    release = failed.deferred_release
    assert not failed.success and release is not None
    # set only once the killed process is reaped (a later poll of the same step may
    # have reaped it already: the manager releases at its next poll of the tier)
    assert not release.is_set() or e.proc.returncode == -signal.SIGKILL
    assert sorted(primary._deferred_rows) == rows
    assert e.free_rows().isdisjoint(rows)
    with m.lock:
        assert [primary.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
        data = m.get_stats().data["data"]
        assert m.has_pending_work()
    assert data[metrics.DEFERRED_RELEASE_CHUNKS] == {label: 3}
    assert data[metrics.PROMOTION_JOB_FAILURES] == {label: 1}

    e.until(lambda: not primary.num_deferred_release_chunks, "the rows were never released")
    assert e.proc.returncode == -signal.SIGKILL
    assert set(rows) <= e.free_rows()
    with m.lock:
        data = m.get_stats().data["data"]
        assert [m.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3  # the request failed
        m.on_request_finished(ctx)
    assert data[metrics.DEFERRED_RELEASE_CHUNKS] == {label: 0}
    assert len(data[metrics.DEFERRED_RELEASE_HOLD][label]) == 1
    e.until(lambda: e.p2p.endpoint.proc is not None and e.p2p.endpoint.proc.pid != old_pid
            and e.p2p.endpoint.ready,
            "no new endpoint")
    assert e.p2p.endpoint.restarts == 1


@pytest.mark.timeout(120)
def test_drain_jobs_returns_only_once_every_release_is_set(stopped_endpoint):
    """A reset while a promotion waits on the stopped endpoint: drain_jobs kills it at the
    load's deadline and returns only once the process is reaped, with the failed load's
    deferred_release set; the manager then releases the rows and resets."""
    from shmtier import metrics

    e = stopped_endpoint()
    keys = [chunk_key(i) for i in (4, 5)]
    ctx, rows = e.promote_with_endpoint_stopped(keys)
    results = e.record_results()
    with e.m.lock:
        e.m.reset_cache()  # raises if drain_jobs returned with an event unset
        data = e.m.get_stats().data["data"]
        e.m.on_reset_flushed()
    assert e.proc.returncode == -signal.SIGKILL
    [failed] = results
    assert not failed.success and failed.deferred_release is not None
    assert failed.deferred_release.is_set()
    assert e.primary.num_deferred_release_chunks == 0 and set(rows) <= e.free_rows()
    assert len(data[metrics.DEFERRED_RELEASE_HOLD][("1:p2p",)]) == 1


@pytest.mark.timeout(120)
def test_parked_chunks_need_no_engine_steps(engines, keys):
    """Once a PD prefill request finished and its chunks are parked, the tier reports no
    pending work (vLLM steps an engine while there is: an idle prefill server would spin
    until its decoder fetched, for up to ``unbound_store_timeout_s``). With the producer's
    engine not stepping at all, its endpoint serves the consumer byte-exact, and the
    producer's next step unpins the fetched rows."""
    prod, cons = engines((tier(keys.a), {}), (tier(keys.b), {}))
    ks = [91, 92, 93]
    sent = prod.call("produce", "p1", "kv-idle", ks, 0)
    deadline = time.monotonic() + 10
    while prod.call("idle", True):  # the store job's result, then nothing is pending
        assert time.monotonic() < deadline, "the producer still has pending work"
        prod.call("idle", False)
        time.sleep(0.05)
    assert prod.call("stats")["parked"] == len(ks)
    assert all(r > 0 for r in prod.call("refs", ks))  # parked: pinned
    got = cons.call("consume", "c1", pd("kv-idle", prod.port), ks, 40, 20)
    assert got["answers"][-1] == ["HIT"] * len(ks) and got["data"] == sent
    # the peer's release reaches the producer's tier without a step (its poll thread or
    # the next step); the rows are unpinned by the step that takes the jobs' results
    deadline = time.monotonic() + 10
    while prod.call("stats")["parked"]:
        assert time.monotonic() < deadline, "the consumer's release never reached the producer"
        time.sleep(0.05)
    prod.call("step")
    assert prod.call("refs", ks) == [0] * len(ks)
    assert not prod.call("step")
