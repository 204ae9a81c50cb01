"""Cascade admission (shmtier/scheduler/tiering/admission.py): each rule's decisions on
fixed inputs, the config keys, and second_touch through the spec with real tier workers
and an fs tier (real files), promotions byte-exact."""

from __future__ import annotations

import pytest
import torch
from fs_engine import GPU_BLOCKS, HIT, MISS, PENDING, engines, key  # noqa: F401

from shmtier.config import ConfigError, TieringConfig
from shmtier.contract import ReqContext
from shmtier.scheduler.tiering.admission import (
    RULES,
    AdmitAll,
    CascadeAdmission,
    SecondTouch,
    make_rule,
)

K = [f"k{i}" for i in range(8)]
WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"


# --- the rules: deterministic inputs -> decision ---

def test_all_cascades_every_stored_chunk_in_order_and_nothing_on_a_hit():
    rule = AdmitAll()
    assert rule.on_store([K[2], K[0], K[1]]) == [K[2], K[0], K[1]]
    assert rule.on_store([K[2]]) == [K[2]]  # stored again: cascaded again (write-through)
    assert rule.on_hits([K[0], K[3]]) == []
    rule.on_promoted([K[4]])
    assert (rule.admitted, rule.skipped) == (4, 0)


def test_second_touch_skips_a_first_store_and_cascades_a_second_one():
    rule = SecondTouch(window=16)
    assert rule.on_store([K[0], K[1]]) == []
    assert rule.on_store([K[1], K[2]]) == [K[1]]  # K[1] stored again: it was recomputed
    assert rule.on_store([K[1]]) == [K[1]]  # and again: the tier did not serve it
    assert (rule.admitted, rule.skipped) == (2, 3)


def test_second_touch_cascades_a_stored_chunk_on_its_first_cpu_tier_hit_only():
    rule = SecondTouch(window=16)
    assert rule.on_store([K[0], K[1], K[2]]) == []
    assert rule.on_hits([K[1], K[0]]) == [K[1], K[0]]  # re-read while resident
    assert rule.on_hits([K[0], K[1], K[2]]) == [K[2]]  # the first two are admitted already
    assert rule.on_hits([K[0], K[1], K[2]]) == []


def test_second_touch_counts_a_hit_on_a_key_it_does_not_know_as_a_first_touch():
    rule = SecondTouch(window=16)
    assert rule.on_hits([K[5]]) == []
    assert rule.on_hits([K[5]]) == [K[5]]


def test_second_touch_never_cascades_a_promoted_chunk_on_a_hit():
    rule = SecondTouch(window=16)
    rule.on_promoted([K[3]])
    assert rule.on_hits([K[3]]) == []
    assert rule.on_store([K[3]]) == [K[3]]  # stored again (recomputed): the tier lost it


def test_second_touch_remembers_at_most_window_keys_least_recently_touched_first_out():
    rule = SecondTouch(window=2)
    assert rule.on_store([K[0], K[1]]) == []
    assert rule.on_hits([K[0]]) == [K[0]]  # K[0] touched last: K[1] is the oldest now
    assert rule.on_store([K[2]]) == []  # remembering K[2] forgets K[1]
    assert len(rule) == 2
    assert rule.on_store([K[1]]) == []  # forgotten: a first touch again
    assert rule.on_store([K[2]]) == [K[2]]  # K[2] was kept: K[0] went out
    assert rule.on_hits([K[0]]) == []


@pytest.mark.parametrize("window", [0, -3])
def test_second_touch_refuses_a_window_under_one(window):
    with pytest.raises(ValueError, match=rf"window = {window} is invalid: expected an integer >= 1"):
        SecondTouch(window)


def test_make_rule_names_every_rule_and_refuses_others():
    assert [make_rule(n, 4).name for n in RULES] == list(RULES)
    with pytest.raises(ValueError, match=r"admission = 'lru' is invalid: expected one of all, second_touch"):
        make_rule("lru", 4)


def test_cascade_admission_is_none_when_every_tier_writes_through():
    assert CascadeAdmission.build(["all"], 8) is None
    assert CascadeAdmission.build(["all", "all"], 8) is None
    assert CascadeAdmission.build([], 8) is None


def test_cascade_admission_decides_per_tier_and_exempts_request_level_tiers():
    adm = CascadeAdmission.build(["all", "second_touch", "second_touch"], 8)
    # tier 0 writes through; tier 1 admits; tier 2 is a request-level tier of this request
    assert adm.on_store([K[0], K[1]], exempt={2}) == [(0, [K[0], K[1]]), (2, [K[0], K[1]])]
    assert adm.on_hits([K[1]]) == [(1, [K[1]])]  # tier 2 holds K[1]: not again
    adm.on_promoted(1, [K[5]])
    adm.on_promoted(0, [K[6]])  # tier 0's rule keeps nothing
    assert adm.on_hits([K[5], K[6]]) == []  # first touches, but K[5] for tier 1 (it holds it)
    assert adm.on_hits([K[5], K[6]]) == [(1, [K[6]]), (2, [K[5], K[6]])]


# --- the config keys ---

def test_config_default_is_write_through_for_every_tier(tmp_path):
    (tmp_path / "lower").mkdir()
    tiers = [{"type": "fs", "root_dir": str(tmp_path)},
             {"type": "fs", "root_dir": str(tmp_path / "lower")}]  # one namespace each
    cfg = TieringConfig.from_extra_config({"secondary_tiers": tiers})
    assert (cfg.admission, cfg.admission_window) == ("all", None)
    assert cfg.admission_rules() == ("all", "all")


def test_config_top_level_rule_and_a_tier_override(tmp_path):
    (tmp_path / "lower").mkdir()
    tiers = [{"type": "fs", "root_dir": str(tmp_path)},
             {"type": "fs", "root_dir": str(tmp_path / "lower"), "admission": "all"}]
    cfg = TieringConfig.from_extra_config({"secondary_tiers": tiers, "admission": "second_touch",
                                           "admission_window": 100})
    assert cfg.admission_rules() == ("second_touch", "all")
    assert cfg.admission_window == 100
    assert cfg.secondary_tiers[1].admission == "all"  # taken out of the fs tier's own options


@pytest.mark.parametrize("extra, message", [
    ({"admission": "lfu"}, "kv_connector_extra_config['admission'] = 'lfu' is invalid: "
                           "expected one of 'all', 'second_touch'"),
    ({"admission": True}, "kv_connector_extra_config['admission'] = True is invalid: "
                          "expected one of 'all', 'second_touch'"),
    ({"admission_window": 0}, "kv_connector_extra_config['admission_window'] = 0 is invalid: "
                              "expected an integer >= 1"),
    ({"secondary_tiers": [{"type": "fs", "root_dir": "/tmp", "admission": "second"}]},
     "secondary_tiers[0].admission = 'second' is invalid: expected one of 'all', 'second_touch'"),
])
def test_config_refuses_a_bad_value_naming_key_value_and_what_is_accepted(extra, message):
    with pytest.raises(ConfigError) as e:
        TieringConfig.from_extra_config(extra)
    assert str(e.value) == message


# --- through the spec: real tier workers, real files ---

def _kv_files(root):
    return sorted(root.rglob("*.kv"))


def _cascaded_bytes(e) -> int:
    with e.manager.lock:
        data = e.manager.get_stats().data["data"]
    return sum(data.get(WRITE_BYTES, {}).values())


def test_default_spec_keeps_write_through(engines, tmp_path):
    e = engines(tmp_path, chunks=4)
    assert e.manager.admission is None
    e.offload([key(i) for i in range(3)], 0, ReqContext("a"))
    e.settle()
    assert len(_kv_files(tmp_path)) == 3


def test_second_touch_writes_only_chunks_touched_twice_and_promotes_them_byte_exact(engines, tmp_path):
    e = engines(tmp_path, chunks=8, admission="second_touch")
    assert e.manager.admission.rules[0].name == "second_touch"
    m = e.manager
    stored = [key(i) for i in range(4)]
    writer = ReqContext("writer")
    e.offload(stored, 0, writer)  # GPU blocks 0..3: the first touch of each chunk
    with m.lock:
        m.on_request_finished(writer)
    e.settle()
    assert _kv_files(tmp_path) == []  # stored once: nothing cascaded
    # another request re-reads the first two while the CPU tier holds them: a second touch
    rereader = ReqContext("rereader")
    with m.lock:
        assert [m.lookup(k, rereader) for k in stored[:2]] == [HIT, HIT]
    e.load(stored[:2], rereader, [40, 41])  # prepare_load ends the scan: the two cascade
    e.settle()
    assert len(_kv_files(tmp_path)) == 2
    written = _cascaded_bytes(e)
    assert written > 0
    # eight other chunks evict all four from the CPU tier (and are first touches)
    filler = ReqContext("filler")
    e.offload([key(100 + i) for i in range(8)], 8, filler)
    with m.lock:
        m.on_request_finished(filler)
    e.settle()
    assert len(_kv_files(tmp_path)) == 2
    reader = ReqContext("reader")
    # the two written come back from the fs tier; the two never cascaded are gone (MISS)
    assert e.answers_settled(stored, reader) == [HIT, HIT, MISS, MISS]
    with m.lock:
        assert m.lookup(stored[2], reader) is MISS
    dst = [60, 61]
    loaded = e.load(stored[:2], reader, dst)
    assert torch.equal(loaded, e.originals[0][0:2])  # byte-exact after the round trip
    # a hit on a promoted chunk does not write it again
    again = ReqContext("again")
    with m.lock:
        assert [m.lookup(k, again) for k in stored[:2]] == [HIT, HIT]
    e.load(stored[:2], again, [62, 63])
    e.settle()
    assert len(_kv_files(tmp_path)) == 2 and _cascaded_bytes(e) == 0  # (get_stats resets)
    # the third chunk, recomputed and stored again, is written this time
    recompute = ReqContext("recompute")
    e.offload([stored[2]], 2, recompute)
    e.settle()
    assert len(_kv_files(tmp_path)) == 3
    e.offload([key(200 + i) for i in range(8)], 16, ReqContext("filler2"))  # evict it
    e.settle()
    final = ReqContext("final")
    assert e.answers_settled([stored[2]], final) == [HIT]
    assert torch.equal(e.load([stored[2]], final, [70]), e.originals[0][2:3])
    assert GPU_BLOCKS > 70
