"""Issue 28, defect 8, through vLLM's own factory: the connector keys vLLM reads from
``kv_connector_extra_config`` (``offload_prompt_only``, ``sync_load_budget_bytes``...)
are checked when vLLM's ``OffloadingSpecFactory`` builds shmtier's spec; a value vLLM
reads as meant reaches vLLM's spec attribute unchanged (tests/test_connector_keys.py
checks every key and value against the core spec)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm_harness  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from shmtier.config import ConfigError  # noqa: E402

SPEC = {"spec_name": "ShmTierOffloadingSpec", "spec_module_path": "shmtier.vllm",
        "cpu_bytes_to_use": 1 << 20}


def create(engine_id, **extra):
    return OffloadingSpecFactory.create_spec(
        vllm_harness.offloading_config({**SPEC, **extra}, engine_id))


def test_offload_prompt_only_means_what_the_config_says(engine_id):
    for value in (False, True):
        assert create(engine_id, offload_prompt_only=value).offload_prompt_only is value


@pytest.mark.parametrize("key, value", [
    ("offload_prompt_only", "false"),  # vLLM: bool("false") is True
    ("self_describing_kv_events", "no"),
    ("sync_load_budget_bytes", "lots"),  # vLLM: int("lots") raises only in the scheduler
])
def test_a_value_vllm_would_misread_is_refused_by_the_factory(engine_id, key, value):
    with pytest.raises(ConfigError, match=rf"\[{key!r}\] = {value!r} is invalid: expected"):
        create(engine_id, **{key: value})
