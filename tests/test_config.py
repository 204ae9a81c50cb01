"""Every invalid configuration value fails with an error naming key, value and what is accepted."""

from __future__ import annotations

import pytest

from shmtier.config import ConfigError, KVLayout, PrimaryTierConfig

LAYOUT = KVLayout(model="m", dtype="bfloat16", gpu_block_size=16,
                  worker_kv_bytes_per_block=64 << 10, world_size=2)


def parse(**extra):
    return PrimaryTierConfig.from_extra_config(extra, LAYOUT)


def test_defaults_and_geometry():
    config = parse(cpu_bytes_to_use=1 << 30)
    assert (config.blocks_per_chunk, config.eviction_policy, config.store_threshold) == (1, "lru", 0)
    g = config.geometry(LAYOUT)
    assert (g.row_stride, g.page_size_per_worker, g.num_chunks) == (128 << 10, 64 << 10, 8192)
    assert parse(cpu_bytes_to_use=1 << 30, block_size=64).blocks_per_chunk == 4
    assert parse(cpu_bytes_to_use=1 << 30, blocks_per_chunk=2, eviction_policy="arc").blocks_per_chunk == 2


@pytest.mark.parametrize("extra, message", [
    ({}, r"\['cpu_bytes_to_use'\] is required"),
    ({"cpu_bytes_to_use": 0}, r"\['cpu_bytes_to_use'\] = 0 is invalid: expected an integer >= 1"),
    ({"cpu_bytes_to_use": "8GiB"}, r"\['cpu_bytes_to_use'\] = '8GiB' is invalid"),
    ({"cpu_bytes_to_use": True}, r"\['cpu_bytes_to_use'\] = True is invalid"),
    ({"cpu_bytes_to_use": 1000}, r"= 1000 is smaller than one chunk row of 131072 bytes"),
    ({"cpu_bytes_to_use": 1 << 30, "block_size": 24}, r"\['block_size'\] = 24 is invalid: expected a multiple of the GPU block size 16"),
    ({"cpu_bytes_to_use": 1 << 30, "block_size": 32, "blocks_per_chunk": 2}, r"both 'block_size' = 32 and 'blocks_per_chunk' = 2"),
    ({"cpu_bytes_to_use": 1 << 30, "blocks_per_chunk": 0}, r"\['blocks_per_chunk'\] = 0 is invalid"),
    ({"cpu_bytes_to_use": 1 << 30, "eviction_policy": "mru"}, r"eviction_policy='mru' is not a known cache policy; accepted: \['lru', 'arc'\]"),
    ({"cpu_bytes_to_use": 1 << 30, "eviction_policy": 3}, r"\['eviction_policy'\] = 3 is invalid"),
    ({"cpu_bytes_to_use": 1 << 30, "eviction_policy": "X", "cache_policy_module_path": "nope_mod"}, r"cache_policy_module_path='nope_mod' cannot be imported"),
    ({"cpu_bytes_to_use": 1 << 30, "store_threshold": 2}, r"\['store_threshold'\] = 2 is not supported by the tiering spec: use 0 or 1"),
    ({"cpu_bytes_to_use": 1 << 30, "store_threshold": -1}, r"\['store_threshold'\] = -1 is invalid"),
    ({"cpu_bytes_to_use": 1 << 30, "max_tracker_size": 0}, r"\['max_tracker_size'\] = 0 is invalid"),
    ({"cpu_bytes_to_use": 1 << 30, "key_width": 300}, r"\['key_width'\] = 300 is invalid: expected an integer in 5..255"),
    ({"cpu_bytes_to_use": 1 << 30, "warm_restart": "yes"}, r"\['warm_restart'\] = 'yes' is invalid: expected true or false"),
    ({"cpu_byte_to_use": 1 << 30}, r"unknown key\(s\) 'cpu_byte_to_use' \(did you mean 'cpu_bytes_to_use'\?\)"),
])
def test_invalid_values_name_key_value_and_accepted(extra, message):
    with pytest.raises(ConfigError, match=message):
        PrimaryTierConfig.from_extra_config(extra, LAYOUT)


def test_store_threshold_allowed_for_the_plain_cpu_tier():
    config = PrimaryTierConfig.from_extra_config(
        {"cpu_bytes_to_use": 1 << 30, "store_threshold": 3}, LAYOUT, tiering=False)
    assert config.store_threshold == 3


def test_vllm_connector_keys_pass_through():
    parse(cpu_bytes_to_use=1 << 30, spec_name="ShmTierOffloadingSpec", spec_module_path="shmtier.vllm",
          offload_prompt_only=True)


def test_fingerprint_changes_with_layout():
    config = parse(cpu_bytes_to_use=1 << 30)
    other = KVLayout(model="m", dtype="float16", gpu_block_size=16,
                     worker_kv_bytes_per_block=64 << 10, world_size=2)
    assert config.fingerprint(LAYOUT) != config.fingerprint(other)
