"""The suite's tier assertion cannot pass where no tier worked (issue 27: a broken tier
must fail the suite, not pass silently).

``assert_tier_served`` is given the /metrics window of a real request that reused a
prefix on the reference server (the engine without offloading: its device cache served
the prefix, no tier did), and must raise for every tier label the scenarios use. The
other negative check, corrupted fs chunk files, is part of
``test_fs_tiers.test_cpu_fs_tiers_restart_and_shared_root``.
"""

from __future__ import annotations

import pytest

from .e2e_chats import ask
from .e2e_metrics import CPU_TIER, DEVICE_HIT_TOKENS, Metrics, assert_tier_served


@pytest.mark.parametrize("tier", [CPU_TIER, "1:fs", "1:obj", "1:p2p", "1:node"])
def test_tier_assertion_fails_without_tier_work(reference, prompts, tier):
    server = reference.server
    reference.answer([prompts.user("assertions", 200)], 1)  # started, prefix cached
    before = Metrics.scrape(server)
    ask(server, [prompts.user("assertions", 200)], 1)  # the same prompt, not memoized
    d = Metrics.scrape(server) - before
    assert d.value(DEVICE_HIT_TOKENS) > 0, "the prompt asked again was no prefix hit"
    with pytest.raises(AssertionError, match=f"tier {tier} served nothing"):
        assert_tier_served(d, tier)
