"""Issue 12, shared fs root: engines with separate segments and worker pools, one root.

A key an engine's index does not know is probed by its workers (RETRY, then HIT or
MISS), so an engine serves chunks another engine stored after it started; corrupt
files and another engine's deletes never give wrong bytes."""

from __future__ import annotations

import time

from fs_engine import END, GPU_BLOCKS, HIT, MISS, PENDING, RETRY, engines, key  # noqa: F401
import torch

from shmtier.contract import ReqContext
from shmtier.tiers.fs import scheduler as fs_tier


def _fs(engine):
    return engine.manager.tiers[0]


def test_an_engine_promotes_chunks_another_stored_after_it_started(engines, tmp_path):
    b = engines(tmp_path, chunks=40)
    b.settle()  # B's listing of the (empty) root has landed: B knows of no chunk
    a = engines(tmp_path, chunks=40)
    keys = [key(i) for i in range(32)]
    a.offload(keys, 0, ReqContext("a"))
    a.settle()  # cascaded: 32 files on disk
    assert len(list(tmp_path.rglob("*.kv"))) == 32
    ctx = ReqContext("b")
    seen = b.until_hit(keys, ctx)
    assert seen[0] == [RETRY] * 32  # unknown to B's index: probed first
    got = b.load(keys, ctx, list(range(40, 72)))
    assert torch.equal(got, a.originals[0][:32])  # byte-exact, from A's files
    data = b.manager.get_stats().data["data"]
    assert data[fs_tier.PROBE_HITS][("1:fs",)] == 32
    assert data[fs_tier.PROBED_KEYS][("1:fs",)] == 32
    assert data[fs_tier.BYTES_ON_DISK][("1:fs",)] == sum(
        p.stat().st_size for p in tmp_path.rglob("*.kv"))  # adopted chunks count


def test_an_unknown_key_is_a_miss_after_one_probe_and_the_miss_is_remembered(engines, tmp_path):
    e = engines(tmp_path)
    e.settle()
    ctx = ReqContext("r")
    first = e.answers_settled([key(7)], ctx)
    assert first == [MISS]
    data = e.manager.get_stats().data["data"]
    assert data[fs_tier.PROBED_KEYS][("1:fs",)] == 1
    with e.manager.lock:  # within probe_ttl_s: MISS again without a probe
        assert e.manager.lookup(key(7), ctx) is MISS
        e.manager.on_schedule_end(END)
    assert fs_tier.PROBED_KEYS not in e.manager.get_stats().data["data"]


def test_probe_unknown_false_misses_at_once(engines, tmp_path):
    e = engines(tmp_path, probe_unknown=False)
    e.settle()
    with e.manager.lock:
        assert e.manager.lookup(key(7), ReqContext("r")) is MISS


def test_a_corrupt_file_is_a_miss_on_both_engines(engines, tmp_path):
    a = engines(tmp_path, chunks=4)
    b = engines(tmp_path, chunks=8)
    keys = [key(i) for i in range(4)]
    a.offload(keys, 0, ReqContext("a"))
    a.settle()
    a.offload([key(100 + i) for i in range(4)], 4, ReqContext("a2"))  # evicts keys from A's CPU
    a.settle()
    victim = next(p for p in tmp_path.rglob("*.kv") if p.name == keys[0].hex() + ".kv")
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0xFF
    victim.write_bytes(bytes(raw))
    for engine, base in ((b, 40), (a, 40)):  # B loads first: it removes the corrupt file
        ctx = ReqContext(f"r{base}")
        answers = engine.answers_settled(keys, ctx)
        assert answers == [MISS, HIT, HIT, HIT], answers
        got = engine.load(keys[1:], ctx, list(range(base, base + 3)))
        assert torch.equal(got, a.originals[0][1:4])
    assert not victim.exists()
    total = sum(engine.manager.get_stats().data["data"].get(fs_tier.CORRUPT_CHUNKS, {})
                .get(("1:fs",), 0) for engine in (a, b))
    assert total == 1  # found corrupt once (by B), then gone for A: a plain MISS


def test_an_engine_evicting_files_while_another_loads_them_never_gives_wrong_bytes(
        engines, tmp_path):
    one = 8192 + 200  # a chunk's file at most (8 KiB of KV and the frame header)
    a = engines(tmp_path, chunks=8, max_bytes=6 * one)
    b = engines(tmp_path, chunks=8)
    blocks = {}  # key -> A's GPU block holding its bytes
    loaded = missed = 0
    for rnd in range(12):
        new = [key(1000 + 4 * rnd + i) for i in range(4)]
        first = (4 * rnd) % (GPU_BLOCKS - 40)
        a.offload(new, first, ReqContext(f"a{rnd}"))
        a.settle()  # on disk
        blocks.update({k: first + i for i, k in enumerate(new)})
        # more cascades of A, which evict its oldest files while B looks and loads
        a.offload([key(5000 + 4 * rnd + i) for i in range(4)], GPU_BLOCKS - 8, ReqContext("x"))
        recent = list(blocks)[-8:]  # some evicted by A's max_bytes already, or about to be
        ctx = ReqContext(f"b{rnd}")
        answers = b.answers_while(a, recent, ctx)
        hits = [k for k, ans in zip(recent, answers) if ans is HIT]
        missed += len(recent) - len(hits)
        if hits:
            dst = list(range(GPU_BLOCKS - 40, GPU_BLOCKS - 40 + len(hits)))
            got = b.load(hits, ctx, dst)
            for row, k in zip(got, hits):
                assert torch.equal(row, a.originals[0][blocks[k]]), "wrong bytes served"
            loaded += len(hits)
        a.settle()
        b.settle()
    assert loaded > 0 and missed > 0, (loaded, missed)
    data = b.manager.get_stats().data["data"]
    assert data["vllm:kv_offload_tiering_read_bytes"][("1:fs",)] > 0  # promoted from A's files


def test_lookups_of_keys_the_index_knows_answer_at_once_without_a_probe(engines, tmp_path):
    e = engines(tmp_path, chunks=4)
    keys = [key(i) for i in range(4)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    tier = _fs(e)
    t = time.perf_counter()
    with e.manager.lock:
        assert [tier.lookup(k, ReqContext("r")) for k in keys] == [HIT] * 4
    assert time.perf_counter() - t < 0.05
    assert fs_tier.PROBED_KEYS not in e.manager.get_stats().data["data"]


def test_workers_starting_on_a_fresh_root_do_not_reset_the_namespace(engines, tmp_path, caplog):
    """The worker that makes the namespace at engine start is no reset: its first result
    (maybe after the other worker stored chunks) must not drop the index."""
    e = engines(tmp_path, chunks=16, workers=2)
    for rnd in range(4):
        e.offload([key(10 * rnd + i) for i in range(4)], 4 * rnd, ReqContext(f"a{rnd}"))
        e.settle()
    assert _fs(e).namespace_resets == 0
    assert "made anew" not in caplog.text
    assert len(_fs(e).indexed_chunks()) == 16


def test_a_key_probed_absent_then_stored_is_a_hit(engines, tmp_path):
    """A miss remembered from a probe does not outlive the key's own store (it once made
    the stored chunk a MISS for as long as requests kept asking)."""
    e = engines(tmp_path, chunks=4)
    keys = [key(i) for i in range(4)]
    ctx = ReqContext("r")
    assert e.answers_settled(keys, ctx) == [MISS] * 4  # probed: absent
    e.offload(keys, 0, ctx)
    e.settle()
    e.offload([key(100 + i) for i in range(4)], 4, ReqContext("b"))  # keys leave the CPU tier
    e.settle()
    assert e.answers_settled(keys, ctx) == [HIT] * 4  # promoted from the tier


def _plant_big(path) -> None:
    """A sparse file over 4 GiB at ``path`` (``truncate -s 5G``: costs no disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    with open(path, "wb") as f:
        f.truncate(5 << 30)


def _chunk_file(root, k):
    return next(p for p in root.rglob("*.kv") if p.name == k.hex() + ".kv")


def test_a_file_over_4_gib_named_like_a_chunk_fails_no_promotion_of_its_neighbours(
        engines, tmp_path):
    """Issue 28 item 4, inside a promotion: one of 8 indexed chunks' files replaced by a
    file no chunk could be (over 4 GiB, whose size the result's 32-bit field cannot
    carry) is that key's MISS, removed; the 7 others promote byte-exact (the whole job
    failed: 7 good keys MISS, the big one left indexed)."""
    e = engines(tmp_path, chunks=8)
    keys = [key(i) for i in range(8)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    e.offload([key(100 + i) for i in range(8)], 8, ReqContext("b"))  # out of the CPU tier
    e.settle()
    big = _chunk_file(tmp_path, keys[0])
    _plant_big(big)
    ctx = ReqContext("r")
    assert e.answers_settled(keys, ctx) == [MISS] + [HIT] * 7
    got = e.load(keys[1:], ctx, list(range(40, 47)))
    assert torch.equal(got, e.originals[0][1:8])
    assert not big.exists()
    assert keys[0] not in _fs(e).indexed_chunks()


def test_a_file_over_4_gib_named_like_a_chunk_does_not_stop_the_listing(engines, tmp_path):
    """Issue 28 item 4, the listing: an engine starting on a root that holds such a file
    lists the root (it retried for ever: with ``probe_unknown`` false a never-stored key
    answered RETRY for good, and with ``max_bytes`` nothing was stored again); the file
    is removed, the chunks beside it are indexed and promote, and stores go on."""
    a = engines(tmp_path, chunks=8)
    keys = [key(i) for i in range(4)]
    a.offload(keys, 0, ReqContext("a"))
    a.settle()
    big = _chunk_file(tmp_path, keys[0])
    _plant_big(big)
    b = engines(tmp_path, chunks=8, probe_unknown=False, max_bytes=1 << 20)
    b.settle(timeout_s=20)  # the listing landed
    assert not big.exists()
    assert set(_fs(b).indexed_chunks()) == set(keys[1:])
    ctx = ReqContext("r")
    with b.manager.lock:  # never stored: a MISS at once, not RETRY
        assert b.manager.lookup(key(77), ctx) is MISS
    assert b.answers_settled(keys, ctx) == [MISS, HIT, HIT, HIT]
    got = b.load(keys[1:], ctx, list(range(40, 43)))
    assert torch.equal(got, a.originals[0][1:4])
    new = [key(200 + i) for i in range(4)]
    b.offload(new, 8, ReqContext("c"))
    b.settle()
    assert set(new) <= set(_fs(b).indexed_chunks())
    assert {_chunk_file(tmp_path, k).name for k in new}  # on disk
