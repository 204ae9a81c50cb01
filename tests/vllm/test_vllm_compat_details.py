"""Details that code written for vLLM 0.33 relies on, checked against vLLM's own classes
with the same input: the wording errors lead with, and what vLLM's tier factory does
with a tier's ``backpressure`` block."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.cpu.policies.factory import (  # noqa: E402
    CachePolicyFactory as VllmCachePolicyFactory,
)
from vllm.v1.kv_offload.tiering.factory import (  # noqa: E402
    SecondaryTierFactory as VllmSecondaryTierFactory,
)

from shmtier.config import ConfigError, KVLayout  # noqa: E402
from shmtier.scheduler.policies.factory import CachePolicyFactory  # noqa: E402
from shmtier.scheduler.tiering.factory import SecondaryTierFactory  # noqa: E402
from shmtier.spec import TieringOffloadingSpec  # noqa: E402

LAYOUT = KVLayout("m", "bfloat16", 16, 8192, 1)


def first_sentence(message: str) -> str:
    """vLLM's leading phrase: up to the first sentence end (or the whole message)."""
    match = re.match(r"(.+?[.])(\s|$)", message)
    return match.group(1) if match else message


def vllm_error(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def test_unknown_cache_policy_leads_with_vllms_words():
    theirs = first_sentence(vllm_error(lambda: VllmCachePolicyFactory.get_cache_policy_cls("mru")))
    assert theirs == "Unknown cache policy: 'mru'."
    with pytest.raises(ValueError) as ours:
        CachePolicyFactory.get_cache_policy_cls("mru")
    assert str(ours.value).startswith(theirs)
    assert "accepted: ['lru', 'arc']" in str(ours.value)  # and our richer text follows
    with pytest.raises(ConfigError) as built:  # the same when the spec is built
        TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20, "eviction_policy": "mru"}, LAYOUT, "x")
    assert str(built.value).startswith(theirs)


def test_a_tier_without_type_leads_with_vllms_words():
    theirs = vllm_error(lambda: VllmSecondaryTierFactory.get_tier_class({}))
    assert theirs == "Secondary tier configuration must include 'type'"
    for call in (lambda: SecondaryTierFactory.get_tier_class({}),
                 lambda: TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20,
                                                "secondary_tiers": [{}]}, LAYOUT, "x")):
        with pytest.raises(ValueError) as ours:
            call()
        assert str(ours.value).startswith(theirs)
        assert "secondary_tiers[" in str(ours.value)


def test_an_unknown_tier_type_leads_with_vllms_words():
    theirs = first_sentence(vllm_error(lambda: VllmSecondaryTierFactory.get_tier_class({"type": "nfs"})))
    assert theirs == "Unknown secondary tier type: 'nfs'."
    for call in (lambda: SecondaryTierFactory.get_tier_class({"type": "nfs"}),
                 lambda: TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20,
                                                "secondary_tiers": [{"type": "nfs"}]}, LAYOUT, "x")):
        with pytest.raises(ValueError) as ours:
            call()
        assert str(ours.value).startswith(theirs)


def test_create_secondary_tier_builds_the_detector_of_a_backpressure_block():
    """Called directly with a tier dict (as vLLM's spec and tests call it), the factory
    turns the tier's ``backpressure`` block into the tier's detector, as vLLM's does."""
    config = {"type": "example", "backpressure": {"backpressure_cls": "EMABackpressureDetector",
                                                 "high_water_s": 0.5, "low_water_s": 0.1}}
    view = memoryview(bytearray(4096 * 2)).cast("B", (2, 4096))
    theirs = VllmSecondaryTierFactory.create_secondary_tier(dict(config), view, None)
    ours = SecondaryTierFactory.create_secondary_tier(dict(config), view, None)
    assert type(theirs.bp_detector).__name__ == type(ours.bp_detector).__name__ == \
        "EMABackpressureDetector"
    assert ours.bp_detector.high_water_s == theirs.bp_detector._high == 0.5
    assert ours.bp_detector.low_water_s == theirs.bp_detector._low == 0.1
    plain = SecondaryTierFactory.create_secondary_tier({"type": "example"}, view, None)
    assert plain.bp_detector is None is VllmSecondaryTierFactory.create_secondary_tier(
        {"type": "example"}, view, None).bp_detector
