"""The p2p tier's transport (shmtier/tiers/p2p): keys, circuit, and a ChunkServer in another
process serving a ChunkClient in this one over real sockets on 127.0.0.1.

Servers run in spawned processes (tests/p2p_peer.py) on free ports they bind themselves;
every process, socket and key directory is removed at the end, also when a test fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")

import p2p_peer  # noqa: E402  (tests/ is on sys.path)
from shmtier.shared.jobs import Outcome  # noqa: E402
from shmtier.tiers.p2p.endpoint.circuit import PeerCircuit  # noqa: E402
from shmtier.tiers.p2p.keys import (AllowList, CurveKeyPair, KeyFileError,  # noqa: E402
                                    generate_keypair_files, keypair_from_config, load_keypair,
                                    load_public_key, parse_key)
from shmtier.tiers.p2p.endpoint.transport import ChunkClient, ChunkServer  # noqa: E402

CTX = mp.get_context("spawn")
FP = "layout-fp-test"
SEED = 4242
SIZES = [1, 4097, 256 * 1024 + 1, int(1.4 * 2 ** 20)]
CHUNKS = ([(b"k%d" % s, s) for s in SIZES] + [(b"flip-1", 65536), (b"plain-1", 65536)]
          + [(b"slow-%d" % i, 256 * 1024) for i in range(20)])
SIZE_OF = dict(CHUNKS)


# --------------------------------------------------------------------------- fixtures


@dataclass
class Peer:
    proc: mp.Process
    conn: object
    port: int
    warnings: list

    def counters(self) -> dict:
        self.conn.send("counters")
        assert self.conn.poll(10), "server process did not answer"
        return self.conn.recv()


class Peers:
    """Server processes started by a test (or module); all stopped and reaped by close()."""

    def __init__(self):
        self.started: list[Peer] = []

    def start(self, spec: dict) -> Peer:
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=p2p_peer.serve, args=(child, spec), daemon=True)
        proc.start()
        child.close()
        peer = Peer(proc, parent, 0, [])
        self.started.append(peer)
        assert parent.poll(30), "server process did not start"
        tag, peer.port, peer.warnings = parent.recv()
        assert tag == "ready"
        return peer

    def close(self) -> None:
        for p in self.started:
            if p.proc.is_alive():
                os.kill(p.proc.pid, signal.SIGCONT)
                try:
                    p.conn.send("stop")
                except OSError:
                    pass
                p.proc.join(3)
            if p.proc.is_alive():
                p.proc.kill()
                p.proc.join(3)
            p.conn.close()
        self.started.clear()


@pytest.fixture(scope="module")
def keys():
    """A server key pair, an allowed client, a stranger; the allow-list directory holds
    only the client's public key."""
    d = tempfile.mkdtemp(prefix="shmtier-p2p-keys-")
    try:
        generate_keypair_files(os.path.join(d, "server"), "server")
        generate_keypair_files(os.path.join(d, "client"), "client")
        generate_keypair_files(os.path.join(d, "stranger"), "stranger")
        os.makedirs(os.path.join(d, "allowed"))
        shutil.copy(os.path.join(d, "client", "client.key"), os.path.join(d, "allowed"))
        yield SimpleNamespace(
            dir=d, server_secret=os.path.join(d, "server", "server.key_secret"),
            allow_dir=os.path.join(d, "allowed"),
            server=load_keypair(os.path.join(d, "server", "server.key_secret")),
            client=load_keypair(os.path.join(d, "client", "client.key_secret")),
            stranger=load_keypair(os.path.join(d, "stranger", "stranger.key_secret")))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _spec(keys, **over) -> dict:
    spec = dict(chunks=CHUNKS, fingerprint=FP, hash_seed=SEED, secret_file=keys.server_secret,
                allow_dir=keys.allow_dir, slow_s=0.1)
    spec.update(over)
    return spec


@pytest.fixture(scope="module")
def shared_server(keys):
    """One Curve server for the tests that do not stop or kill theirs."""
    peers = Peers()
    try:
        yield peers.start(_spec(keys))
    finally:
        peers.close()


@pytest.fixture
def peers():
    p = Peers()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def clients():
    made: list[ChunkClient] = []

    def make(port: int, keys_=None, server_key=None, **kw) -> ChunkClient:
        kw.setdefault("fingerprint", FP)
        kw.setdefault("hash_seed", SEED)
        c = ChunkClient("127.0.0.1", port, keys=keys_, server_key=server_key, **kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


def _rows(keys_: list[bytes]) -> np.ndarray:
    return np.zeros((len(keys_), max(SIZE_OF.get(k, 16) for k in keys_)), np.uint8)


def _dests(arena: np.ndarray, keys_: list[bytes]) -> list:
    return [arena[r, :SIZE_OF.get(k, 16)] for r, k in enumerate(keys_)]


def _delta(before: dict, after: dict, reason: str) -> int:
    return after["refused_handshakes"].get(reason, 0) - before["refused_handshakes"].get(reason, 0)


# --------------------------------------------------------------------------- keys, circuit


def test_keys_files_config_allow_list_and_their_errors(tmp_path):
    pub, sec = generate_keypair_files(str(tmp_path / "k"), "engine-a")
    assert stat.S_IMODE(os.stat(sec).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(pub).st_mode) == 0o644
    pair = load_keypair(sec)
    assert load_public_key(pub) == pair.public and zmq.curve_public(pair.secret) == pair.public
    assert "secret=<set>" in repr(pair) and pair.secret.decode() not in repr(pair)
    with pytest.raises(KeyFileError, match="exists already"):
        generate_keypair_files(str(tmp_path / "k"), "engine-a")
    with pytest.raises(KeyFileError, match=r"engine-a\.key: holds no secret key"):
        load_keypair(pub)
    with pytest.raises(KeyFileError, match="does not exist"):
        load_keypair(str(tmp_path / "nope.key_secret"))
    (tmp_path / "junk.key").write_text("hello\n")
    with pytest.raises(KeyFileError, match=r"junk\.key: no 'public-key"):
        load_public_key(str(tmp_path / "junk.key"))
    (tmp_path / "short.key").write_text('public-key = "abc"\n')
    with pytest.raises(KeyFileError, match=r"short\.key \(public-key\): a Curve key is 40"):
        load_public_key(str(tmp_path / "short.key"))
    with pytest.raises(KeyFileError, match="peer_key: a Curve key is 40 Z85 characters, got 3"):
        parse_key("abc", "peer_key")
    for text in ("~" * 40, "#" * 40):  # not Z85; Z85 whose groups overflow 32 bits
        with pytest.raises(KeyFileError, match="peer_key: not valid Z85 text"):
            parse_key(text, "peer_key")
    # config: the public key is derived from the secret, or checked against it
    assert keypair_from_config(pair.secret.decode()).public == pair.public
    other = CurveKeyPair(*zmq.curve_keypair())
    with pytest.raises(KeyFileError, match="does not belong"):
        keypair_from_config(pair.secret, other.public)
    # allow-lists: a directory of *.key files or a list; never empty
    allow = AllowList.from_directory(str(tmp_path / "k"))
    assert pair.public in allow and zmq.utils.z85.decode(pair.public) in allow
    assert other.public not in allow and len(allow) == 1
    assert other.public in AllowList.from_keys([other.public.decode()])
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyFileError, match=r"empty: no \*\.key public key files"):
        AllowList.from_directory(str(tmp_path / "empty"))
    with pytest.raises(KeyFileError, match="does not exist"):
        AllowList.from_directory(str(tmp_path / "missing"))
    with pytest.raises(KeyFileError, match=r"allowed_keys entry 1: a Curve key is 40"):
        AllowList.from_keys([other.public, "x" * 39])
    # the command line
    out = subprocess.run([sys.executable, "-m", "shmtier.tiers.p2p.keys", "generate",
                          str(tmp_path / "cli"), "b"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    shown = subprocess.run([sys.executable, "-m", "shmtier.tiers.p2p.keys", "show",
                            str(tmp_path / "cli" / "b.key")], capture_output=True, text=True)
    assert shown.stdout.strip() in out.stdout
    assert stat.S_IMODE(os.stat(tmp_path / "cli" / "b.key_secret").st_mode) == 0o600


def test_peer_circuit_backs_off_doubling_to_its_cap_and_resets_on_success():
    now = [0.0]
    c = PeerCircuit(base_s=1.0, cap_s=4.0, clock=lambda: now[0])
    assert c.allow() and c.state == "closed"
    expected = [1.0, 2.0, 4.0, 4.0]
    for backoff in expected:
        c.record_failure()
        assert c.backoff_s == backoff and c.state == "open" and not c.allow()
        now[0] += backoff - 0.01
        assert not c.allow()
        now[0] += 0.01
        assert c.state == "half-open" and c.allow()
    assert c.fast_failures == 2 * len(expected)
    c.record_success()
    assert c.state == "closed" and c.retry_in() == 0.0
    c.record_failure()
    assert c.backoff_s == 1.0
    with pytest.raises(ValueError):
        PeerCircuit(base_s=2.0, cap_s=1.0)


def test_construction_demands_keys_unless_plaintext(keys):
    with pytest.raises(ValueError, match="needs keys="):
        ChunkServer("127.0.0.1", 0, provider=dict().get, fingerprint=FP, hash_seed=SEED)
    with pytest.raises(ValueError, match="needs allow="):
        ChunkServer("127.0.0.1", 0, provider=dict().get, fingerprint=FP, hash_seed=SEED,
                    keys=keys.server)
    with pytest.raises(ValueError, match="needs server_key="):
        ChunkClient("127.0.0.1", 1, fingerprint=FP, hash_seed=SEED, keys=keys.client)
    c = ChunkClient("127.0.0.1", 1, fingerprint=FP, hash_seed=SEED, plaintext=True)
    with pytest.raises(ValueError, match="too_many_keys"):  # a caller's bug, not the peer's
        c.lookup([b"k"] * 5000, 1.0)
    with pytest.raises(ValueError, match="destinations"):
        c.fetch([b"k"], [], 1.0)
    with pytest.raises(ValueError, match="read-only"):
        c.fetch([b"k"], [b"\0"], 1.0)
    assert c.circuit.state == "closed" and c.counters.requests == 0
    c.close()
    with pytest.raises(ValueError, match="plaintext=True takes no keys"):
        ChunkClient("127.0.0.1", 1, fingerprint=FP, hash_seed=SEED, keys=keys.client,
                    plaintext=True)


# --------------------------------------------------------------------------- serving


def test_fetch_is_byte_exact_into_numpy_rows_and_misses_are_misses(keys, shared_server, clients):
    c = clients(shared_server.port, keys.client, keys.server.public)
    want = [b"k%d" % s for s in SIZES] + [b"absent"]
    arena = _rows(want)
    arena[:] = 0xEE
    before = shared_server.counters()
    r = c.fetch(want, _dests(arena, want), timeout_s=5.0)
    assert r.outcomes == [Outcome.OK] * len(SIZES) + [Outcome.MISS], r.details
    for row, k in enumerate(want[:-1]):
        size = SIZE_OF[k]
        assert np.array_equal(arena[row, :size], p2p_peer.chunk_bytes(k, size))
        assert (arena[row, size:] == 0xEE).all()  # nothing past the chunk written
    assert r.nbytes[:-1] == SIZES
    after = shared_server.counters()
    assert after["requests"] - before["requests"] == 1
    assert after["bytes_sent"] - before["bytes_sent"] == sum(SIZES)
    assert c.counters.bytes_received == sum(SIZES) and c.counters.misses == 1
    # the session stays open: a second fetch reuses it
    r2 = c.fetch([want[-2]], [arena[0, :SIZE_OF[want[-2]]]], timeout_s=5.0)
    assert r2.all_ok and c.counters.handshakes == 1
    # a destination of the wrong size: CORRUPT (length), the row not to be used
    r3 = c.fetch([b"k4097"], [arena[0, :4096]], timeout_s=5.0)
    assert r3.outcomes == [Outcome.CORRUPT] and r3.details[0].startswith("length")


def test_lookup_answers_per_key(keys, shared_server, clients):
    c = clients(shared_server.port, keys.client, keys.server.public)
    assert c.lookup([b"k1", b"nope", b"flip-1"], timeout_s=5.0) == [True, False, True]
    assert c.lookup([], timeout_s=5.0) == []


def test_unknown_client_key_is_refused_at_the_handshake_and_counted(keys, shared_server, clients):
    before = shared_server.counters()
    c = clients(shared_server.port, keys.stranger, keys.server.public)
    t0 = time.monotonic()
    r = c.fetch([b"k1"], [np.zeros(1, np.uint8)], timeout_s=5.0)
    assert time.monotonic() - t0 < 2.0
    assert r.outcomes == [Outcome.ERROR] and "allow-list" in r.details[0]
    assert c.lookup([b"k1"], 5.0) is None and "circuit open" in c.last_error  # fails fast now
    after = shared_server.counters()
    assert _delta(before, after, "unknown_key") >= 1
    assert (after["requests"], after["lookups"], after["chunks"], after["handshakes"]) == (
        before["requests"], before["lookups"], before["chunks"], before["handshakes"])


def test_client_expecting_another_server_key_fails_cleanly(keys, shared_server, clients):
    before = shared_server.counters()
    c = clients(shared_server.port, keys.client, keys.stranger.public)
    t0 = time.monotonic()
    r = c.fetch([b"k1"], [np.zeros(1, np.uint8)], timeout_s=5.0)
    assert time.monotonic() - t0 < 2.0
    assert r.outcomes == [Outcome.ERROR] and "handshake" in r.details[0]
    assert c.counters.refused_handshakes == {"handshake": 1}
    after = shared_server.counters()
    assert _delta(before, after, "handshake_crypto") >= 1
    assert after["chunks"] == before["chunks"] and after["handshakes"] == before["handshakes"]


@pytest.mark.parametrize("case", ["endpoint_dies_mid_handshake", "another_server_key"])
def test_a_broken_handshake_says_what_happened(keys, peers, clients, caplog, case):
    """Issue 28: a peer whose endpoint dies while this client's CurveZMQ handshake is
    under way (stopped, so the kernel took the connection but nobody answered; then
    killed: the connection is reset and nothing listens any more) is reported as gone
    mid-handshake, not as holding another public key; a peer that holds another key
    than the server_key given (it closes every handshake) is reported as that. Both
    within the call's timeout, counted as a refused handshake, the circuit open."""
    server = peers.start(_spec(keys))
    if case == "endpoint_dies_mid_handshake":
        c = clients(server.port, keys.client, keys.server.public)
        os.kill(server.proc.pid, signal.SIGSTOP)
        killer = threading.Timer(0.5, os.kill, (server.proc.pid, signal.SIGKILL))
        killer.start()
    else:
        c = clients(server.port, keys.client, keys.stranger.public)
        killer = None
    try:
        with caplog.at_level("WARNING", logger="shmtier.tiers.p2p.endpoint.client"):
            t0 = time.monotonic()
            r = c.fetch([b"k1"], [np.zeros(1, np.uint8)], timeout_s=4.0)
            took = time.monotonic() - t0
    finally:
        if killer is not None:
            killer.cancel()
            server.proc.join(5)
    assert took < 2.0, took
    assert r.outcomes == [Outcome.ERROR]
    logged = " ".join(rec.getMessage() for rec in caplog.records)
    if case == "endpoint_dies_mid_handshake":
        assert "went away during the CurveZMQ handshake" in r.details[0], r.details
        assert "nothing listens" in r.details[0] and "server_key" not in r.details[0]
        assert "went away during the CurveZMQ handshake" in logged and "server_key" not in logged
    else:
        assert "is not the server_key given" in r.details[0], r.details
        assert "went away" not in r.details[0]
    assert c.counters.refused_handshakes == {"handshake": 1} and c.circuit.state == "open"


@pytest.mark.parametrize("field,value", [("fingerprint", "another-layout"),
                                         ("hash_seed", SEED + 1)])
def test_other_layout_or_hash_seed_is_refused_and_counted(keys, shared_server, clients,
                                                          field, value):
    before = shared_server.counters()
    c = clients(shared_server.port, keys.client, keys.server.public, **{field: value})
    arena = np.zeros((1, SIZE_OF[b"k1"]), np.uint8)
    r = c.fetch([b"k1"], [arena[0]], timeout_s=5.0)
    assert r.outcomes == [Outcome.ERROR] and r.details[0].startswith(f"refused by 127.0.0.1")
    assert field in r.details[0] and not arena.any()
    after = shared_server.counters()
    assert _delta(before, after, field) == 1
    assert after["chunks"] == before["chunks"] and after["requests"] == before["requests"]


def test_bytes_corrupted_in_flight_are_corrupt_never_ok(keys, shared_server, clients):
    c = clients(shared_server.port, keys.client, keys.server.public)
    want = [b"k4097", b"flip-1", b"plain-1"]
    arena = _rows(want)
    r = c.fetch(want, _dests(arena, want), timeout_s=5.0)
    assert r.outcomes == [Outcome.OK, Outcome.CORRUPT, Outcome.OK]
    assert r.details[1] == "checksum" and c.counters.checksum_failures == 1
    assert np.array_equal(arena[2, :65536], p2p_peer.chunk_bytes(b"plain-1", 65536))
    assert c.circuit.state == "closed"  # a bad chunk is not a dead peer


# --------------------------------------------------------------------------- failures


def test_server_killed_mid_fetch_gives_error_within_the_timeout(keys, peers, clients):
    server = peers.start(_spec(keys))
    c = clients(server.port, keys.client, keys.server.public)
    want = [b"slow-%d" % i for i in range(20)]  # 0.1 s each at the server: 2 s in all
    arena = _rows(want)
    killer = threading.Timer(0.5, os.kill, (server.proc.pid, signal.SIGKILL))
    killer.start()
    try:
        t0 = time.monotonic()
        r = c.fetch(want, _dests(arena, want), timeout_s=4.0)
        took = time.monotonic() - t0
    finally:
        killer.cancel()
    assert took < 4.0 + 0.5  # seen here: ~0 s after the kill (the socket monitor says so)
    assert Outcome.ERROR in r.outcomes and set(r.outcomes) <= {Outcome.OK, Outcome.ERROR}
    for row, (k, o) in enumerate(zip(want, r.outcomes)):
        if o == Outcome.OK:
            assert np.array_equal(arena[row, :SIZE_OF[k]], p2p_peer.chunk_bytes(k, SIZE_OF[k]))
    # the peer is gone: calls fail fast, then time out within their bound once retried
    assert c.lookup([b"k1"], 1.0) is None and "circuit open" in c.last_error


def test_a_peer_restarted_between_calls_is_served_by_the_next_call(keys, peers, clients):
    first = peers.start(_spec(keys))
    c = clients(first.port, keys.client, keys.server.public)
    k = b"k%d" % SIZES[1]
    row = np.zeros(SIZE_OF[k], np.uint8)
    assert c.fetch([k], [row], timeout_s=5.0).all_ok
    first.proc.kill()
    first.proc.join(5)
    second = peers.start(_spec(keys, port=first.port))  # the same address, a new process
    row[:] = 0
    r = c.fetch([k], [row], timeout_s=5.0)
    assert r.all_ok, r.details
    assert np.array_equal(row, p2p_peer.chunk_bytes(k, SIZE_OF[k]))
    assert c.counters.handshakes == 2 and c.circuit.state == "closed"
    assert second.counters()["handshakes"] == 1


def test_stopped_server_times_out_while_another_keeps_serving(keys, peers, shared_server,
                                                             clients):
    stalled = peers.start(_spec(keys))
    slow_client = clients(stalled.port, keys.client, keys.server.public)
    good_client = clients(shared_server.port, keys.client, keys.server.public)
    assert slow_client.connect(5.0)  # the session was fine before the stall
    os.kill(stalled.proc.pid, signal.SIGSTOP)
    out = {}

    def stalled_fetch():
        t0 = time.monotonic()
        out["r"] = slow_client.fetch([b"k1"], [np.zeros(1, np.uint8)], timeout_s=1.0)
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=stalled_fetch)
    t.start()
    k = b"k%d" % SIZES[-1]
    row = np.zeros(SIZE_OF[k], np.uint8)
    times = []
    while t.is_alive():
        t0 = time.monotonic()
        r = good_client.fetch([k], [row], timeout_s=5.0)
        times.append(time.monotonic() - t0)
        assert r.all_ok, r.details
    t.join()
    assert out["r"].outcomes == [Outcome.ERROR] and out["r"].details[0].startswith("timeout")
    assert 1.0 <= out["took"] < 1.5
    assert len(times) >= 3 and max(times) < 0.5, times
    assert np.array_equal(row, p2p_peer.chunk_bytes(k, SIZE_OF[k]))
    t0 = time.monotonic()
    r = slow_client.fetch([b"k1"], [np.zeros(1, np.uint8)], timeout_s=1.0)
    assert "circuit open" in r.details[0] and time.monotonic() - t0 < 0.05
    assert slow_client.counters.timeouts == 1 and slow_client.counters.fast_failures == 1


def test_plaintext_mode_works_and_says_so(keys, peers, clients, caplog):
    server = peers.start(_spec(keys, plaintext=True))
    assert any("PLAINTEXT" in w for w in server.warnings), server.warnings
    with caplog.at_level("WARNING", logger="shmtier.tiers.p2p"):
        c = clients(server.port, plaintext=True)
    assert "PLAINTEXT" in caplog.text
    k = b"k%d" % SIZES[-1]
    row = np.zeros(SIZE_OF[k], np.uint8)
    assert c.fetch([k], [row], timeout_s=5.0).all_ok
    assert np.array_equal(row, p2p_peer.chunk_bytes(k, SIZE_OF[k]))
    # a Curve client does not get through to a plaintext server
    curve = clients(server.port, keys.client, keys.server.public)
    r = curve.fetch([k], [row], timeout_s=1.0)
    assert r.outcomes == [Outcome.ERROR]


def test_request_scoped_fetch_deferred_lookup_and_done():
    """The p2p tier's use of the transport (plaintext, server on a thread here): a fetch
    naming ``req`` reads only ``request_provider(req, key)``; a lookup naming ``req`` is
    answered later by the owner (``answer_lookup``); ``done`` reaches ``on_done``."""
    rows = {("r1", b"k1"): np.arange(64, dtype=np.uint8)}
    tokens, done, stop = [], [], threading.Event()
    server = ChunkServer("127.0.0.1", 0, provider=lambda key: None, fingerprint=FP,
                         hash_seed=SEED, plaintext=True,
                         request_provider=lambda req, key: rows.get((req, key)),
                         lookup_handler=lambda token, req, keys: tokens.append((token, req, keys)),
                         on_done=lambda req, keys: done.append(req if keys is None
                                                               else (req, keys)))

    def loop():
        while not stop.is_set():
            server.poll(0.005)
            while tokens:
                token, req, keys = tokens.pop()
                server.answer_lookup(token, [req == "r1" and k == b"k1" for k in keys])

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    client = ChunkClient("127.0.0.1", server.port, fingerprint=FP, hash_seed=SEED,
                         plaintext=True)
    try:
        dest = np.zeros(64, np.uint8)
        assert client.fetch([b"k1"], [dest], 5, req="r1").all_ok
        assert (dest == rows["r1", b"k1"]).all()
        res = client.fetch([b"k1"], [np.zeros(64, np.uint8)], 5, req="r2")  # other request
        assert res.outcomes == [Outcome.MISS]
        res = client.fetch([b"k1"], [np.zeros(64, np.uint8)], 5)  # unscoped: provider
        assert res.outcomes == [Outcome.MISS]
        assert client.lookup([b"k1", b"k2"], 5, req="r1") == [True, False]
        assert client.done("r1", 5, [b"k1"])  # done with just that key of it
        assert client.done("r1", 5)
        deadline = time.monotonic() + 5
        while done != [("r1", [b"k1"]), "r1"]:
            assert time.monotonic() < deadline, done
            time.sleep(0.01)
        with pytest.raises(ValueError):
            client.fetch([b"k1"], [dest], 5, req="x" * 300)
    finally:
        client.close()
        stop.set()
        thread.join(5)
        server.close()


def test_requests_bound_to_a_peer_and_complete_requests():
    """``request_owner``: a fetch, lookup or done naming a request bound to another peer
    is refused (counted; fetch: each key ERROR "not_bound", lookup: all False, done: not
    delivered), nothing served; the bound peer is served. ``request_complete``: a miss
    of a complete request is final (``FetchResult.final``), of another one is not."""
    rows = {("r1", b"k1"): np.arange(64, dtype=np.uint8)}
    done, stop = [], threading.Event()
    server = ChunkServer("127.0.0.1", 0, provider=lambda key: None, fingerprint=FP,
                         hash_seed=SEED, plaintext=True,
                         request_provider=lambda req, key: rows.get((req, key)),
                         request_owner={"r1": ("me:1", "")}.get,
                         request_complete={"r2"}.__contains__,
                         on_done=lambda req, keys: done.append(req))
    thread = threading.Thread(target=lambda: server.serve(stop.is_set, 0.005), daemon=True)
    thread.start()
    other = ChunkClient("127.0.0.1", server.port, fingerprint=FP, hash_seed=SEED,
                        plaintext=True, name="other:2")
    me = ChunkClient("127.0.0.1", server.port, fingerprint=FP, hash_seed=SEED,
                     plaintext=True, name="me:1")
    try:
        dest = np.zeros(64, np.uint8)
        res = other.fetch([b"k1"], [dest], 5, req="r1")
        assert res.outcomes == [Outcome.ERROR] and "not_bound" in res.details[0]
        assert not dest.any()
        assert other.lookup([b"k1"], 5, req="r1") == [False]
        assert other.done("r1", 5)
        assert other.circuit.failures == 0  # a refused request is no peer failure
        res = me.fetch([b"k1"], [dest], 5, req="r1")
        assert res.all_ok and (dest == rows["r1", b"k1"]).all()
        assert me.fetch([b"k9"], [dest], 5, req="r2").final == [True]
        assert me.fetch([b"k9"], [dest], 5, req="r3").final == [False]
        assert me.done("r1", 5)
        deadline = time.monotonic() + 5
        while done != ["r1"]:  # only the bound peer's done arrived
            assert time.monotonic() < deadline, done
            time.sleep(0.01)
        assert server.counters.refused_requests == 3
        assert server.counters.bytes_sent == 64
    finally:
        other.close()
        me.close()
        stop.set()
        thread.join(5)
        server.close()


def test_checksums_given_with_the_rows_are_sent_not_recomputed(monkeypatch):
    """A provider may hand ``(row, crc)``, the CRC-32C taken when the row was parked (the
    p2p endpoint's use): the server sends that crc without reading the row again. In one
    pipelined fetch (answers streamed, one request for all keys) a row changed after its
    crc was taken fails only its own key (CORRUPT "checksum"), a malformed crc only its own
    key (ERROR), and the others land byte-exact in their rows."""
    from shmtier.shared.codec import crc32c
    from shmtier.tiers.p2p.endpoint import server as server_mod

    sizes = [1, 4097, 65536, int(1.4 * 2 ** 20)]
    rows = {b"k%d" % i: np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
            for i, n in enumerate(sizes)}
    given = {k: (v, crc32c(v)) for k, v in rows.items()}
    stale = np.arange(4097, dtype=np.uint8)
    given[b"stale"] = (stale, crc32c(stale))
    stale[7] ^= 0xFF  # written after its checksum was taken
    given[b"badcrc"] = (rows[b"k1"], "not-a-crc")
    server_calls = []
    monkeypatch.setattr(server_mod, "crc32c", lambda buf: server_calls.append(1) or crc32c(buf))
    stop = threading.Event()
    server = ChunkServer("127.0.0.1", 0, provider=given.get, fingerprint=FP, hash_seed=SEED,
                         plaintext=True)
    thread = threading.Thread(target=lambda: server.serve(stop.is_set, 0.005), daemon=True)
    thread.start()
    client = ChunkClient("127.0.0.1", server.port, fingerprint=FP, hash_seed=SEED,
                         plaintext=True)
    try:
        want = [b"k3", b"stale", b"k0", b"badcrc", b"k2", b"k1", b"none"]
        size = {b"stale": 4097, b"badcrc": 4097, b"none": 8}
        dests = [np.zeros(size.get(k) or len(rows[k]), np.uint8) for k in want]
        res = client.fetch(want, dests, 10)
        assert res.outcomes == [Outcome.OK, Outcome.CORRUPT, Outcome.OK, Outcome.ERROR,
                                Outcome.OK, Outcome.OK, Outcome.MISS]
        assert res.details[1] == "checksum" and "not-a-crc" in res.details[3]
        for k, d, o in zip(want, dests, res.outcomes):
            if o == Outcome.OK:
                assert np.array_equal(d, rows[k]), k
        assert server_calls == []  # every crc came with its row
        assert client.counters.checksum_failures == 1 and client.circuit.state == "closed"
    finally:
        client.close()
        stop.set()
        thread.join(5)
        server.close()


def test_pipelined_fetches_answered_out_of_order_land_in_their_rows():
    """``fetch_many`` sends every request before reading: a server (a plain ROUTER here,
    speaking the wire by hand, on a real socket) that waits for all three requests and
    answers their chunks shuffled across requests still gets each chunk into its own
    call's row, byte-exact; one chunk whose bytes fail its checksum fails only that key
    of that call; an answer for an unknown request id is ignored."""
    from shmtier.shared.codec import crc32c
    from shmtier.tiers.p2p.endpoint import wire

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    data = {b"a%d" % i: np.random.default_rng(i).integers(0, 256, 1000 + 999 * i, np.uint8)
            for i in range(7)}
    calls = [[b"a0", b"a1", b"a2"], [b"a3"], [b"a4", b"a5", b"a6"]]
    seen, errors = [], []

    def serve():
        try:
            fetches = []
            while len(fetches) < len(calls):
                assert router.poll(10000), "no request"
                peer, frame = router.recv_multipart()
                msg = wire.unpack(frame)
                if msg["t"] == "hello":
                    router.send_multipart([peer, wire.pack({"t": "hello_ok", "v": 1,
                                                            "name": "hand"})])
                else:
                    fetches.append(msg)
            seen.extend(f["rid"] for f in fetches)
            answers = [(f["rid"], i, k) for f in fetches for i, k in enumerate(f["keys"])]
            np.random.default_rng(5).shuffle(answers)
            router.send_multipart([peer, wire.pack({"t": "chunk", "rid": 999, "i": 0,
                                                    "key": b"a0", "st": "miss"})])
            for rid, i, key in answers:
                body = data[key].copy()
                crc = crc32c(body)
                if key == b"a5":
                    body[3] ^= 1  # corrupted after its checksum was taken
                router.send_multipart([peer, wire.pack(
                    {"t": "chunk", "rid": rid, "i": i, "key": key, "st": "ok",
                     "n": body.nbytes, "crc": crc}), body])
        except Exception as e:  # reported by the test
            errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = ChunkClient("127.0.0.1", port, fingerprint=FP, hash_seed=SEED, plaintext=True)
    try:
        dests = [[np.zeros(data[k].nbytes, np.uint8) for k in keys] for keys in calls]
        results = client.fetch_many([(keys, d, f"r{c}") for c, (keys, d)
                                     in enumerate(zip(calls, dests))], 10)
        thread.join(10)
        assert not errors, errors
        assert len(set(seen)) == 3  # three requests in flight at once
        assert [r.outcomes for r in results] == [
            [Outcome.OK] * 3, [Outcome.OK], [Outcome.OK, Outcome.CORRUPT, Outcome.OK]]
        assert results[2].details[1] == "checksum"
        for keys, ds, res in zip(calls, dests, results):
            for k, d, o in zip(keys, ds, res.outcomes):
                if o == Outcome.OK:
                    assert np.array_equal(d, data[k]), k
        assert client.counters.checksum_failures == 1 and client.circuit.state == "closed"
        with pytest.raises(ValueError):  # a malformed call: nothing is sent
            client.fetch_many([([b"a0"], [np.zeros(1000, np.uint8)], None),
                               ([b"a1"], [], None)], 1)
    finally:
        client.close()
        router.close(0)
        ctx.term()


_RECEIVE_BUFFERS = r'''
import resource, sys, threading
if sys.argv[1] == "keep":
    from shmtier.tiers.p2p.endpoint.process import keep_receive_buffers
    assert keep_receive_buffers()
def rounds():
    faults = []
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        bufs = [bytearray(1468006) for _ in range(8)]  # 8 chunks, every page written
        del bufs
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sum(faults[2:]))
t = threading.Thread(target=rounds)  # a thread's own heap, as libzmq's I/O thread's
t.start()
t.join()
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_endpoint_keeps_freed_receive_buffers_instead_of_faulting_them_in_again():
    """The endpoint's keep_receive_buffers: chunk-sized buffers freed a few at a time (as a
    peer thread frees libzmq's received chunks) are reused without page faults; with
    glibc's defaults the heap is trimmed and every round faults the pages in again."""
    faults = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _RECEIVE_BUFFERS, mode],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        faults[mode] = int(out.stdout)
    pages = 10 * 8 * 1468006 // 4096  # the 10 rounds measured
    assert faults["default"] > pages // 2, faults  # the test can see the trimming
    assert faults["keep"] < pages // 50, faults
