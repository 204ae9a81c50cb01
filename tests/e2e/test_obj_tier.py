"""Two vLLM servers on one ``obj`` bucket (SeaweedFS on 127.0.0.1; issue 27, scenario c).

The SeaweedFS server is the suite-wide fixture of ``tests/s3_servers.py``. A prefix one
server computed is an obj hit for the other; answers are compared with the engine
without offloading.
"""

from __future__ import annotations

import pytest

from .e2e_chats import Conversations
from .e2e_metrics import Metrics, assert_tier_served
from .e2e_server import kv_config
from .e2e_tiers import CPU_ROWS, obj_tier, wait_stable

#: servers start in tens of seconds on 2 cores (more on a busy host)
pytestmark = pytest.mark.timeout(600)

OBJ = "1:obj"


def _objects(s3, bucket: str) -> int:
    c = s3.client()
    try:
        pages = c.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sum(len(p.get("Contents", [])) for p in pages)
    finally:
        c.close()


def test_two_servers_share_an_obj_bucket(serve, cmp, prompts, report, seaweedfs_s3):
    bucket = seaweedfs_s3.new_bucket("e2e")
    tier = obj_tier(seaweedfs_s3, bucket)
    x = serve.start("c-obj-first", kv_config(serve.engine_id("ox"), cpu_rows=CPU_ROWS,
                                             tiers=[tier]))
    y = serve.start("c-obj-second", kv_config(serve.engine_id("oy"), cpu_rows=CPU_ROWS,
                                              tiers=[tier]))
    serve.ready(x, y)

    chats = Conversations(prompts, n=3, tag="c-obj")
    cold = chats.turn(cmp, x)
    chats.turn(cmp, x)
    wait_stable(lambda: _objects(seaweedfs_s3, bucket), at_least=3)
    before = Metrics.scrape(y)
    answers = chats.replay(cmp, y)
    assert_tier_served(Metrics.scrape(y) - before, OBJ, "prefixes the other server computed")
    for a in cold:
        report.ttft("c: shared obj bucket, first turn on the first server", "none (cold)", a)
    for a in answers:
        report.ttft("c: shared obj bucket, the other server's prefix", OBJ, a)
    cmp.assert_identical()
    report.scenario("c: two servers, one obj bucket (SeaweedFS)", cmp.asked,
                    "the other server's prefixes are obj hits")
