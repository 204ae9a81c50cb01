"""Issue 28, defects 8 and 10: every key of ``kv_connector_extra_config`` that vLLM's
connector reads and shmtier passes through is checked when the spec is built, and a key
that is not a string fails as a ``ConfigError``, never a ``TypeError``.

vLLM reads these keys with ``bool(...)`` / ``int(...)`` (docs/vllm-contract.md §12.1;
``offloading/config.py``, ``offloading/scheduler.py`` and ``kv_offload/base.py`` of
0.32-0.34), so a value such as ``"false"`` would mean True to it: shmtier refuses what
vLLM would misread, naming the key, the value and what is accepted. Building the spec
creates nothing (no segment), so nothing is left behind by a refused one.
"""

from __future__ import annotations

import pytest

from shmtier.config import PASSTHROUGH_KEYS, ConfigError, KVLayout
from shmtier.spec import TieringOffloadingSpec

LAYOUT = KVLayout(model="m", dtype="bfloat16", gpu_block_size=16,
                  worker_kv_bytes_per_block=8192, world_size=1)
BASE = {"cpu_bytes_to_use": 1 << 20}

#: Per connector key: values vLLM would misread or that shmtier cannot honour, and what
#: the error must say is accepted. A key added to PASSTHROUGH_KEYS without a check makes
#: test_every_passthrough_key_has_a_check fail.
BAD = {
    "offload_prompt_only": (["false", "true", 0, 1], "true or false"),
    "self_describing_kv_events": (["yes", "false", 1], "true or false"),
    "sync_load_budget_bytes": (["lots", "1000", -1, 1.5, True], "an integer >= 0"),
    "canonical_layout": ([True, "false", "true", 1], "false"),
    "spec_name": ([3, "", ["ShmTierOffloadingSpec"]], "a non-empty string"),
    "spec_module_path": ([5, "", b"shmtier.vllm"], "a non-empty string"),
}
GOOD = {
    "offload_prompt_only": [True, False],
    "self_describing_kv_events": [True, False],
    "sync_load_budget_bytes": [0, 1 << 20, 4.0],
    "canonical_layout": [False],
    "spec_name": ["ShmTierOffloadingSpec"],
    "spec_module_path": ["shmtier.vllm"],
}


def build(extra, engine_id="test-connector-keys"):
    """Build the core spec (what every process of an engine does first)."""
    return TieringOffloadingSpec(extra, LAYOUT, engine_id)


def test_every_passthrough_key_has_a_check():
    assert set(BAD) == set(PASSTHROUGH_KEYS) == set(GOOD)


@pytest.mark.parametrize("key, value, accepted", [
    (k, v, accepted) for k, (values, accepted) in BAD.items() for v in values])
def test_a_connector_key_vllm_would_misread_fails_at_spec_build(key, value, accepted):
    with pytest.raises(ConfigError) as e:
        build({**BASE, key: value})
    text = str(e.value)
    assert f"kv_connector_extra_config[{key!r}] = {value!r} is invalid" in text, text
    assert f"expected {accepted}" in text, text


@pytest.mark.parametrize("key, value", [(k, v) for k, vs in GOOD.items() for v in vs])
def test_values_vllm_reads_as_meant_are_accepted(key, value):
    build({**BASE, key: value})


def test_null_counts_as_absent_as_for_every_other_key():
    build({**BASE, **{k: None for k in PASSTHROUGH_KEYS}})


# --------------------------------------------------------------------------- defect 10

@pytest.mark.parametrize("extra, where", [
    ({**BASE, 1: 2}, "kv_connector_extra_config"),
    ({**BASE, None: 2}, "kv_connector_extra_config"),
    ({**BASE, (1, 2): 2}, "kv_connector_extra_config"),
    ({**BASE, 1: 2, "x": 3}, "kv_connector_extra_config"),
    ({**BASE, b"cpu_bytes_to_use": 1 << 20}, "kv_connector_extra_config"),
    ({**BASE, "secondary_tiers": [{"type": "example", 1: 2}]}, "secondary_tiers[0]"),
    ({**BASE, "secondary_tiers": [{"type": "example", 1: 2, "x": 3}]}, "secondary_tiers[0]"),
    ({**BASE, "secondary_tiers": [{"type": "ExampleSecondaryTierManager",
                                   "module_path": "shmtier.tiers.example.scheduler",
                                   7: "x"}]}, "secondary_tiers[0]"),
])
def test_a_key_that_is_not_a_string_is_a_config_error(extra, where):
    bad = next(k for k in _all_keys(extra) if not isinstance(k, str))
    with pytest.raises(ConfigError) as e:
        build(extra)
    text = str(e.value)
    assert where in text and repr(bad) in text and "not a string" in text, text


def _all_keys(extra):
    yield from extra
    for tier in extra.get("secondary_tiers") or ():
        yield from tier
