"""Two data-parallel replicas of one vLLM server share a prefix through shmtier (issue 31).

One server with ``--data-parallel-size 2``: two EngineCore processes (engine ids
``<engine_id>_dp0`` and ``_dp1``), each with its own shmtier segment and CPU tier, and the
same ``kv_connector_extra_config``, whose secondary tier both replicas share. Replica 0
computes a long prompt; once its chunks are in the shared tier, replica 1 (sent there by
vLLM's ``X-data-parallel-rank`` header) is asked a prompt with the same long prefix. Its
answer must be token for token the reference engine's, and replica 1's own /metrics (the
``engine="1"`` samples) must show the shared tier serving the prefix: chunk hits, bytes
promoted into its CPU tier and loaded into its device cache, vLLM's external prefix-cache
hits for the shared blocks, i.e. not a recompute. After a clean stop nothing of either
replica is left in /dev/shm.
"""

from __future__ import annotations

import pytest

from .e2e_metrics import EXTERNAL_HIT_TOKENS, Metrics, assert_tier_served, tier_figures
from .e2e_server import BLOCK_SIZE, kv_config
from .e2e_tiers import CPU_ROWS, fs_tier, kv_files, wait_stable

#: servers start in tens of seconds on 2 cores (more on a busy host)
pytestmark = pytest.mark.timeout(600)

#: the shared prefix: a system prompt of this many whole blocks (fits the 512-token
#: context with a user turn and the answer)
PREFIX_BLOCKS = 10


def test_dp_replicas_share_a_prefix(serve, cmp, prompts, report):
    root = serve.dir("fs-dp")
    tier = "1:fs"
    kv = kv_config(serve.engine_id("dp"), cpu_rows=CPU_ROWS, tiers=[fs_tier(root)])
    s = serve("f-dp2", kv, data_parallel_size=2, shutdown_timeout_s=30)

    system = prompts.system("f-dp-system", PREFIX_BLOCKS * BLOCK_SIZE)
    before = Metrics.scrape(s)
    cmp.ask(s, [system, prompts.user("f-dp-0")], dp_rank=0, label="replica 0, cold")
    d0 = (Metrics.scrape(s) - before).of_engine(0)
    assert d0.value(EXTERNAL_HIT_TOKENS) == 0, "replica 0's first prompt was a hit"
    # replica 0's cascades of the prefix have landed in the shared tier
    wait_stable(lambda: len(kv_files(root)), at_least=PREFIX_BLOCKS)

    before = Metrics.scrape(s)
    answer = cmp.ask(s, [system, prompts.user("f-dp-1")], dp_rank=1,
                     label="replica 1, the prefix replica 0 computed")
    d1 = (Metrics.scrape(s) - before).of_engine(1)
    f = assert_tier_served(d1, tier, "replica 1, the prefix replica 0 computed")
    assert f["external_hit_tokens"] >= (PREFIX_BLOCKS - 1) * BLOCK_SIZE, (
        f"replica 1 took {f['external_hit_tokens']:g} tokens from shmtier, fewer than the "
        f"shared prefix's {PREFIX_BLOCKS - 1} whole blocks")
    cmp.assert_identical()
    report.ttft("f: two DP replicas, the other replica's prefix", tier, answer)

    assert serve.stop(s) == [], "a clean stop left the replicas' /dev/shm entries"
    figures = ", ".join(f"{k} {v:g}" for k, v in tier_figures(d1, tier).items())
    report.scenario("f: --data-parallel-size 2, one shared tier", cmp.asked,
                    f"replica 1 served replica 0's prefix from {tier}: {figures}")
