"""Two data-parallel replicas of one vLLM server share a prefix through the node pool (issue 31).

One server with ``--data-parallel-size 2``: two EngineCore processes (engine ids
``<engine_id>_dp0`` and ``_dp1``), each with its own shmtier segment and CPU tier, and the
same ``kv_connector_extra_config``, whose ``node`` tier (no ``pool`` given) puts both
replicas in one node pool named by the engine id. Replica 0 computes a long prompt;
once its chunks are READY in the pool, replica 1 (sent there by vLLM's
``X-data-parallel-rank`` header) is asked a prompt with the same long prefix. Its answer
must be token for token the reference engine's, and replica 1's own /metrics (the
``engine="1"`` samples) must show the node tier serving the prefix: chunk hits, bytes
promoted into its CPU tier and loaded into its device cache, vLLM's external prefix-cache
hits for the shared blocks, i.e. not a recompute. After a clean stop nothing of either
replica is left in /dev/shm, the pool's segment included.
"""

from __future__ import annotations

import os

import pytest

from shmtier.tiers.node.layout import shm_name
from shmtier.tiers.node.tools import read_status

from .e2e_metrics import EXTERNAL_HIT_TOKENS, Metrics, assert_tier_served, tier_figures
from .e2e_server import BLOCK_SIZE, DEVICE, ROW_BYTES, SHM_DIR, kv_config, node_pools
from .e2e_tiers import CPU_ROWS, wait_stable

#: servers start in tens of seconds on 2 cores (more on a busy host)
pytestmark = pytest.mark.timeout(600)

#: the shared prefix: a system prompt of this many whole blocks (fits the 512-token
#: context with a user turn and the answer)
PREFIX_BLOCKS = 10
#: the node pool's rows (its ``size_bytes``): a few prompts' worth, for the whole node
POOL_ROWS = 64
NODE = "1:node"


def _gpus() -> int:
    import torch
    return torch.cuda.device_count()


@pytest.mark.skipif(DEVICE == "cuda" and _gpus() < 2,
                    reason="two data-parallel replicas take a GPU each (vLLM places replica "
                           "r on device r); this host has fewer than 2")
def test_dp_replicas_share_a_prefix_through_the_node_pool(serve, cmp, prompts, report):
    kv = kv_config(serve.engine_id("dp"), cpu_rows=CPU_ROWS,
                   tiers=[{"type": "node", "size_bytes": POOL_ROWS * ROW_BYTES}])
    [pool] = node_pools(kv)
    s = serve("f-dp2-node", kv, data_parallel_size=2, shutdown_timeout_s=30)
    status = read_status(pool)
    assert status is not None, f"the replicas made no node pool {pool}"
    engines = {e for e, _, alive in status.engines if alive}
    assert engines == {f"{kv['engine_id']}_dp0", f"{kv['engine_id']}_dp1"}, (
        f"pool {pool}: live engines {sorted(engines)}, not the two replicas")

    system = prompts.system("f-dp-system", PREFIX_BLOCKS * BLOCK_SIZE)
    before = Metrics.scrape(s)
    cmp.ask(s, [system, prompts.user("f-dp-0")], dp_rank=0, label="replica 0, cold")
    d0 = (Metrics.scrape(s) - before).of_engine(0)
    assert d0.value(EXTERNAL_HIT_TOKENS) == 0, "replica 0's first prompt was a hit"
    # replica 0's cascades of the prefix are READY in the pool
    wait_stable(lambda: read_status(pool).used, at_least=PREFIX_BLOCKS)

    before = Metrics.scrape(s)
    answer = cmp.ask(s, [system, prompts.user("f-dp-1")], dp_rank=1,
                     label="replica 1, the prefix replica 0 computed")
    d1 = (Metrics.scrape(s) - before).of_engine(1)
    f = assert_tier_served(d1, NODE, "replica 1, the prefix replica 0 computed")
    assert f["external_hit_tokens"] >= (PREFIX_BLOCKS - 1) * BLOCK_SIZE, (
        f"replica 1 took {f['external_hit_tokens']:g} tokens from shmtier, fewer than the "
        f"shared prefix's {PREFIX_BLOCKS - 1} whole blocks")
    cmp.assert_identical()
    report.ttft("f: two DP replicas, the other replica's prefix", NODE, answer)

    assert serve.stop(s) == [], "a clean stop left the replicas' /dev/shm entries"
    assert not os.path.exists(os.path.join(SHM_DIR, shm_name(pool).lstrip("/"))), (
        f"the last replica out left node pool {pool}")
    figures = ", ".join(f"{k} {v:g}" for k, v in tier_figures(d1, NODE).items())
    report.scenario("f: --data-parallel-size 2, one node pool", cmp.asked,
                    f"replica 1 served replica 0's prefix from the node pool: {figures}")
