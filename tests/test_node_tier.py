"""The ``node`` tier (shmtier/tiers/node/: config, scheduler half, backend) through the real
tiering manager: engines as data-parallel replicas, each in its own process with its own
scheduler, segment, tier workers and fake GPU rank (tests/node_engine.py), sharing one
node pool in /dev/shm; and the config's errors.

Every test removes its engines, their segments and the pool, also when it fails."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

import pytest

import node_engine  # noqa: E402  (tests/ is on sys.path)
from fs_engine import END, MISS, Engine, key  # noqa: E402
from shmtier.options import ConfigError  # noqa: E402
from shmtier.shared.jobs import Outcome  # noqa: E402
from shmtier.shared.segment import SHM_DIR  # noqa: E402
from shmtier.spec import TieringOffloadingSpec  # noqa: E402
from shmtier.config import KVLayout  # noqa: E402
from shmtier.tiers.node import scheduler as node_tier  # noqa: E402
from shmtier.tiers.node.config import default_pool_name  # noqa: E402
from shmtier.tiers.node.layout import H_HOLDER_PID, NAME_PREFIX  # noqa: E402
from shmtier.tiers.node.pool import NodePool  # noqa: E402

CTX = mp.get_context("spawn")
LAYOUT = {"page": 8192, "chunks": 32, "workers": 1}
SMALL = {"size_bytes": 1 << 20}  # 128 rows of 8 KiB (the default, 1 GiB, is faulted in)
PENDING, HIT = "HIT_PENDING", "HIT"


def pool_path(pool: str) -> str:
    return os.path.join(SHM_DIR, NAME_PREFIX + pool)


def pool_stats(pool: str) -> dict:
    with NodePool.open(pool) as p:
        return p.stats()


class Replica:
    """One engine in its own process (``node_engine.serve``)."""

    def __init__(self, engine_id: str, tier: dict, layout: dict):
        self.engine_id = engine_id
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=node_engine.serve, args=(child, engine_id, tier, layout),
                                daemon=True)
        self.proc.start()
        child.close()

    def wait_ready(self, timeout_s: float = 60) -> "Replica":
        assert self.conn.poll(timeout_s), f"{self.engine_id} did not start"
        tag, value = self.conn.recv()
        assert tag == "ready", value
        return self

    def send(self, *cmd) -> None:
        self.conn.send(cmd)

    def result(self, what: str = "", timeout_s: float = 60):
        assert self.conn.poll(timeout_s), f"{self.engine_id} did not answer {what}"
        tag, value = self.conn.recv()
        assert tag == "ok", value
        return value

    def call(self, *cmd, timeout_s: float = 60):
        self.send(*cmd)
        return self.result(cmd[0], timeout_s)

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


@pytest.fixture
def replicas(engine_id):
    """``start(n, tier, layout)``: ``n`` more replicas of one deployment, ids
    ``<engine_id>_dp<rank>`` (the pool's default name is ``engine_id``), started side by
    side; each ready when returned. At the end every replica is stopped and the pool
    removed if one was left."""
    made: list[Replica] = []

    def start(n: int, tier: dict | None = None, layout: dict | None = None) -> list[Replica]:
        new = [Replica(f"{engine_id}_dp{len(made) + i}", tier or SMALL,
                       {**LAYOUT, **(layout or {})})
               for i in range(n)]
        made.extend(new)
        return [r.wait_ready() for r in new]

    start.pool = engine_id
    yield start
    for r in made:
        r.stop()
    if os.path.exists(pool_path(engine_id)):
        os.unlink(pool_path(engine_id))


def test_the_pool_is_named_by_the_engine_id_without_the_replica_suffix():
    assert default_pool_name("abc_dp0") == "abc"
    assert default_pool_name("abc_dp12") == "abc"
    assert default_pool_name("abc_dp") == "abc_dp"  # no rank: not vLLM's suffix
    assert default_pool_name("a_dp1_dp2") == "a_dp1"  # only the last one is the replica's
    odd = default_pool_name("model/x y_dp3")
    assert odd.startswith("model_x_y-") and len(odd) == len("model_x_y-") + 12
    assert default_pool_name("model:x y_dp3") != odd  # never meet by losing characters
    assert len(default_pool_name("e" * 200 + "_dp1")) == 64


def pool_read(pool: str, keys: list[int]) -> bytes:
    """The chunks of ``keys`` as the pool holds them (read and verified by the test
    process itself)."""
    with NodePool.open(pool) as p:
        bufs = [bytearray(p.layout.row_bytes) for _ in keys]
        assert p.load_many([key(k) for k in keys], bufs) == [Outcome.OK] * len(keys)
    return b"".join(bufs)


def test_two_replicas_share_a_prefix_from_the_first_lookup(replicas):
    """A prefix one replica stored is a HIT on the other at its first lookup (the lookup
    answers from the shared index: no RETRY step) and promotes byte-exact; and back. A
    cascade of chunks the pool holds already copies nothing."""
    a, b = replicas(2)
    keys_a, keys_b = list(range(8)), list(range(100, 108))
    stored = a.call("offload", "a1", keys_a, 0)
    got = b.call("consume", "b1", keys_a, 40)
    assert got["answers"][0] == [PENDING] * 8  # the tier's HIT: promoted at once
    assert got["answers"][-1] == [HIT] * 8
    assert got["data"] == stored  # byte-exact, from the other replica's cascade
    stored_b = b.call("offload", "b2", keys_b, 8)
    got_a = a.call("consume", "a2", keys_b, 40)
    assert got_a["answers"][0] == [PENDING] * 8 and got_a["data"] == stored_b
    stats = pool_stats(replicas.pool)
    assert stats["used"] == 16
    engines = {e["engine_id"]: e for e in stats["engines"]}
    assert set(engines) == {a.engine_id, b.engine_id}
    for e in engines.values():
        assert e["stores"] == 8 and e["loads"] == 8 and e["hits"] >= 8
    keys_c = list(range(200, 204))
    stored_c = a.call("offload", "a3", keys_c, 16)
    b.call("offload", "b3", keys_c, 24)  # the same keys from other bytes: nothing copied
    assert b.call("metrics")[node_tier.NODE_FOUND] == 4
    assert pool_read(replicas.pool, keys_c) == stored_c


def test_four_replicas_share_one_pool(replicas):
    """Four replicas, each storing its own part of a prefix: each promotes the others'
    parts from its first lookup, byte-exact."""
    reps = replicas(4)
    parts = [list(range(10 * r, 10 * r + 4)) for r in range(4)]
    stored = [r.call("offload", f"s{i}", parts[i], 0) for i, r in enumerate(reps)]
    whole = [k for part in parts for k in part]
    for i, r in enumerate(reps):
        got = r.call("consume", f"c{i}", whole, 40)
        first = got["answers"][0]
        assert first == [HIT if k in parts[i] else PENDING for k in whole], first
        assert got["answers"][-1] == [HIT] * 16
        assert got["data"] == b"".join(stored)  # each part as its owner stored it
    stats = pool_stats(replicas.pool)
    assert stats["used"] == 16 and len(stats["engines"]) == 4
    assert pool_read(replicas.pool, whole) == b"".join(stored)


def _spec(engine_id, page=8192, **tier):
    layout = KVLayout("m", "bfloat16", 16, page, 1)
    extra = {"cpu_bytes_to_use": 16 * page, "num_tier_workers": 1,
             "secondary_tiers": [{"type": "node", **tier}]}
    return TieringOffloadingSpec(extra, layout, engine_id)


def _no_segment_of(engine_id):
    return not any(e.endswith(engine_id) for e in os.listdir(SHM_DIR))


def test_a_replica_of_another_layout_or_size_is_refused_naming_the_difference(engine_id):
    first = Engine(f"{engine_id}_dp0", None, tier_type="node", workers=1, **SMALL)
    try:
        with pytest.raises(ConfigError) as e:
            _spec(f"{engine_id}_dp1", page=16384, **SMALL).get_manager()
        text = str(e.value)
        assert repr(engine_id) in text  # the pool
        assert "8192" in text and "16384" in text  # row bytes, both values
        assert _no_segment_of(f"{engine_id}_dp1")  # nothing of it left
        with pytest.raises(ConfigError) as e:
            _spec(f"{engine_id}_dp1", size_bytes=2 << 20).get_manager()
        assert "size_bytes is 1048576 in the pool, 2097152 for this engine" in str(e.value)
        stats = pool_stats(engine_id)
        assert [x["engine_id"] for x in stats["engines"]] == [f"{engine_id}_dp0"]
    finally:
        first.close()
    assert not os.path.exists(pool_path(engine_id))


@pytest.mark.parametrize("options, words", [
    ({"size_bytes": "1G"}, "secondary_tiers[0].size_bytes = '1G' is invalid: expected an "
                           "integer >= 1"),
    ({"size_bytes": 4096}, "secondary_tiers[0].size_bytes = 4096 is invalid: expected at "
                           "least one chunk row of this engine's layout (8192 bytes"),
    ({"pool": "a/b"}, "secondary_tiers[0].pool = 'a/b' is invalid: expected a string of 1 to "
                      "64 characters of A-Z a-z 0-9 _ . -, or null"),
    ({"pool": "x" * 65}, "secondary_tiers[0].pool = 'xxxx"),
    ({"keep": "yes"}, "secondary_tiers[0].keep = 'yes' is invalid: expected true or false"),
    ({"sized_bytes": 1}, "size_bytes"),  # unknown key: did you mean
])
def test_invalid_options_name_key_value_and_what_is_accepted(engine_id, options, words):
    with pytest.raises(ConfigError) as e:
        _spec(engine_id, **options)
    assert words in str(e.value)


def test_the_pool_name_is_resolved_when_the_spec_is_built_and_reaches_the_workers(engine_id):
    spec = _spec(f"{engine_id}_dp3", **SMALL)
    (tier,) = spec.tiering_config.secondary_tiers
    assert tier.options.pool == engine_id and tier.options.size_bytes == 1 << 20
    (worker_tier,) = spec.pool_config.tiers
    assert worker_tier.type == "node" and worker_tier.options is tier.options
    named = _spec(f"{engine_id}_dp3", pool="shared-llama")
    assert named.tiering_config.secondary_tiers[0].options.pool == "shared-llama"


def test_two_node_tiers_of_one_engine_on_one_pool_are_refused(engine_id):
    layout = KVLayout("m", "bfloat16", 16, 8192, 1)
    extra = {"cpu_bytes_to_use": 16 * 8192,
             "secondary_tiers": [{"type": "node"}, {"type": "node", "pool": engine_id}]}
    with pytest.raises(ConfigError) as e:
        TieringOffloadingSpec(extra, layout, f"{engine_id}_dp0")
    assert f"secondary_tiers[1].pool = {engine_id!r} is invalid" in str(e.value)


def test_the_last_engine_out_removes_the_pool_unless_keep(engine_id):
    path = pool_path(engine_id)
    a = Engine(f"{engine_id}_dp0", None, tier_type="node", workers=1, **SMALL)
    try:
        b = Engine(f"{engine_id}_dp1", None, tier_type="node", workers=1, **SMALL)
        b.close()
        assert os.path.exists(path)  # a still uses it
    finally:
        a.close()
    assert not os.path.exists(path)
    a = Engine(f"{engine_id}_dp0", None, tier_type="node", workers=1, keep=True, **SMALL)
    try:
        keys = [key(i) for i in range(4)]
        from shmtier.contract import ReqContext
        a.offload(keys, 0, ReqContext("r"))
        a.settle()
    finally:
        a.close()
    try:
        assert os.path.exists(path)  # kept, with its chunks, for a restart
        assert pool_stats(engine_id)["used"] == 4
        b = Engine(f"{engine_id}_dp1", None, tier_type="node", workers=1, **SMALL)
        b.close()  # the last out, without keep: removed
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


BIG = {"page": 1 << 19, "bpc": 4, "chunks": 16}  # 2 MiB chunks: a load's copy takes a while


def test_a_replica_killed_mid_promotion_leaves_the_others_serving(replicas):
    """Replica B is SIGKILLed (its scheduler and tier workers) while its worker holds pins
    on pool rows, copying out a promotion. Replica A keeps serving; a replica C that joins
    afterwards releases B's pins (the attach sweeps dead pinners) and promotes the same
    chunks byte-exact; A's stores can then use every row of the pool."""
    tier = {"size_bytes": 16 << 21}  # 16 rows
    a, b = replicas(2, tier, BIG)
    b_workers = b.call("workers")
    assert len(b_workers) == 1
    watch = NodePool.open(replicas.pool)
    caught = False
    try:
        for round_ in range(15):
            keys = list(range(100 * round_, 100 * round_ + 8))
            stored = a.call("offload", f"a{round_}", keys, 0)
            b.send("consume", f"b{round_}", keys, 32, 60)
            deadline = time.monotonic() + 60
            while not b.conn.poll(0) and time.monotonic() < deadline:
                if watch.stats()["pinned"]:
                    for pid in b_workers:
                        os.kill(pid, signal.SIGSTOP)
                    # copying out with pins held, not stopped inside the pool's lock
                    # (pinning or unpinning: the pin count read then may be torn; a
                    # death inside the lock is the repair's case, tested apart)
                    if watch.stats()["pinned"] and not watch.v.q[H_HOLDER_PID]:
                        caught = True
                        break
                    for pid in b_workers:
                        os.kill(pid, signal.SIGCONT)
            if caught:
                break
            assert b.result("consume")["data"] == stored
    finally:
        if caught:  # B dies: its scheduler and its stopped workers
            for pid in [b.proc.pid, *b_workers]:
                os.kill(pid, signal.SIGKILL)
            b.proc.join(10)
        pinned = watch.stats()["pinned"]
        watch.close()
    assert caught, "never saw B's worker hold a pin"
    assert pinned > 0  # B's dead worker's pins, until a sweep
    before = pool_stats(replicas.pool)["swept"]["pins"]
    (c,) = replicas(1, tier, BIG)  # its attach sweeps B's entry and pins
    stats = pool_stats(replicas.pool)
    assert stats["pinned"] == 0 and stats["swept"]["pins"] - before == pinned
    assert {e["engine_id"] for e in stats["engines"]} == {a.engine_id, c.engine_id}
    got = c.call("consume", "c", keys, 32)
    assert got["answers"][0] == [PENDING] * 8 and got["data"] == stored  # 0 wrong bytes
    for n in range(2):  # A cycles the whole pool: no row stays pinned
        a.call("offload", f"fill{n}", list(range(10_000 + 8 * n, 10_008 + 8 * n)), 0)
    assert node_tier.NODE_REJECTED not in a.call("metrics")
    with NodePool.open(replicas.pool) as p:
        assert p.check() == []
        assert p.stats()["used"] == 16


def test_top_and_ls_show_the_pool_the_engines_using_it_and_their_hit_rates(engine_id):
    from shmtier.contract import ReqContext
    from shmtier.shared.snapshot import snapshot
    from shmtier.top import frame_data, frame_text
    from test_cli import run_cli

    a = Engine(f"{engine_id}_dp0", None, tier_type="node", workers=1, **SMALL)
    try:
        b = Engine(f"{engine_id}_dp1", None, tier_type="node", workers=1, **SMALL)
        try:
            keys = [key(i) for i in range(4)]
            a.offload(keys, 0, ReqContext("a"))
            a.settle()
            ctx = ReqContext("b")
            b.until_hit(keys, ctx)  # the 4 from the pool
            b.load(keys, ctx, list(range(40, 44)))
            with b.manager.lock:  # and one the pool has not
                assert b.manager.lookup(key(99), ReqContext("c")) is MISS
                b.manager.on_schedule_end(END)
            data = frame_data(snapshot(b.spec.engine_id), None)
            (pool,) = data["node"]
            assert pool["pool"] == engine_id and pool["used"] == 4
            engines = {e["engine_id"]: e for e in pool["engines"]}
            assert set(engines) == {a.spec.engine_id, b.spec.engine_id}
            mine = engines[b.spec.engine_id]
            assert mine["hits"] == 4 and mine["lookups"] == 5 and mine["hit_rate"] == 0.8
            assert mine["loads"] == 4 and engines[a.spec.engine_id]["stores"] == 4
            text = frame_text(snapshot(b.spec.engine_id), None)
            assert f"node   pool {engine_id}  rows 4/128" in text
            assert f"{b.spec.engine_id}  pid {os.getpid()} alive  lookups 5 hits 4 (80.0%)" in text
            code, text = run_cli("ls")
            assert code == 0 and f"node({engine_id})" in text  # each engine's tiers
            assert f"node   pool {engine_id}  rows 4/128" in text  # the pool, its engines
            assert text.count(f"  {engine_id}_dp") == 2
            code, text = run_cli("ls", "--host")  # the pools alone
            assert code == 0 and text.startswith(f"node   pool {engine_id}  rows 4/128")
            assert "TIERS" not in text
            code, text = run_cli("ls", "--host", "--json")
            (listed,) = [p for p in json.loads(text)["node"] if p["pool"] == engine_id]
            assert listed["used"] == 4 and {e["engine_id"]: e["hit_rate"]
                                           for e in listed["engines"]} == {
                a.spec.engine_id: None, b.spec.engine_id: 0.8}
        finally:
            b.close()
    finally:
        a.close()


def _kill(replica: Replica, guardian: bool = False) -> None:
    """SIGKILL the replica's scheduler and tier workers (and with ``guardian`` its segment
    guardian first: nothing cleans up after it then but ``shmtier clean``)."""
    pids = [replica.proc.pid, *replica.call("workers")]
    if guardian:
        pids.insert(0, replica.call("guardian"))
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    replica.proc.join(10)


def _gone(path: str, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def test_a_killed_last_engine_leaves_no_pool_unless_keep(replicas):
    """The only engine of a pool is SIGKILLed: its segment guardian removes its segment
    and the pool with it; with ``keep`` the pool stays, its dead entry swept, for the
    next engine (``shmtier clean --node-pools-kept`` removes it)."""
    from test_cli import run_cli

    (a,) = replicas(1)
    a.call("offload", "a", [1, 2], 0)
    _kill(a)
    assert _gone(pool_path(replicas.pool))
    (b,) = replicas(1, {**SMALL, "keep": True})
    b.call("offload", "b", [1, 2], 0)
    _kill(b)
    deadline = time.monotonic() + 30
    while pool_stats(replicas.pool)["engines"] and time.monotonic() < deadline:
        time.sleep(0.05)  # its guardian sweeps the dead entry
    stats = pool_stats(replicas.pool)
    assert stats["engines"] == [] and stats["used"] == 2
    # (engine ids named: other suites' stale segments on the host are theirs)
    code, text = run_cli("clean", b.engine_id, "--node-pool", replicas.pool)
    assert code == 0 and "node pool" not in text and os.path.exists(pool_path(replicas.pool))
    code, text = run_cli("clean", b.engine_id, "--node-pool", replicas.pool,
                         "--node-pools-kept")
    assert code == 0 and f"removed node pool {replicas.pool}" in text
    assert not os.path.exists(pool_path(replicas.pool))


def test_fsck_and_clean_sweep_and_remove_a_pool_whose_engines_died(replicas):
    """A pool whose only engine was SIGKILLed with its guardian stays (its entry names a
    dead engine): ``shmtier fsck --node-pool`` reports the dead engine (exit 1),
    ``--repair`` sweeps it (exit 0), ``shmtier clean`` with the engine's id removes the
    pool."""
    from test_cli import run_cli

    (a,) = replicas(1)
    a.call("offload", "a", [1, 2], 0)
    _kill(a, guardian=True)
    pool = replicas.pool
    assert os.path.exists(pool_path(pool))
    code, text = run_cli("fsck", "--node-pool", pool)
    assert code == 1 and f"dead engine {a.engine_id}" in text and "consistent" in text
    code, text = run_cli("fsck", "--node-pool", pool, "--repair", "--json")
    assert code == 0 and '"engines": 1' in text
    code, text = run_cli("clean", a.engine_id)
    assert code == 0 and f"removed node pool {pool}" in text
    assert f"removed /shmtier_{a.engine_id}" in text  # its segment, left by no guardian
    assert not os.path.exists(pool_path(pool))
    assert run_cli("fsck", "--node-pool", pool)[0] == 2  # no such pool
