"""Counters kept by the tier workers, where a user looks for them: the tier's metrics
(``vllm:kv_offload_shmtier_*``, declared in the spec's metric definitions) and ``shmtier
top`` (issue 28, 9). Real engine (scheduler, segment, tier worker processes, fs tier on
real files); the workers count in their slot's control words (``shared/ring.py``), the
tier's scheduler half exports them, ``top`` reads them from the segment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from fs_engine import HIT, MISS, engines, key  # noqa: F401
from shmtier.contract import ReqContext
from shmtier.spec import TieringOffloadingSpec
from shmtier.storage.tier_metrics import LINKS_REFUSED


def _top(engine_id: str, *args: str) -> str:
    got = subprocess.run([sys.executable, "-m", "shmtier", "top", engine_id, "--once",
                          "--interval", "0.05", *args], capture_output=True, text=True,
                         timeout=60)
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_a_refused_symlink_shows_in_the_metric_and_in_top(engines, tmp_path):
    """A chunk file replaced by a symbolic link to its own valid frame outside the root:
    the promotion's load refuses the link (MISS, never followed). That shows as
    ``links_refused`` of the tier: in its metric (declared, so vLLM's front end takes
    it) and in ``shmtier top`` (text and JSON), not only as a promotion failure."""
    root = tmp_path / "root"
    root.mkdir()
    e = engines(root, chunks=4, workers=1)
    keys = [key(i) for i in range(4)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    (victim,) = root.rglob(keys[0].hex() + ".kv")
    outside = tmp_path / "outside.kv"
    shutil.move(victim, outside)
    os.symlink(outside, victim)
    e.offload([key(10 + i) for i in range(4)], 4, ReqContext("b"))  # evict all four
    e.settle()
    assert e.answers_settled(keys, ReqContext("r")) == [MISS, HIT, HIT, HIT]
    assert os.path.islink(victim) and outside.is_file()  # left alone, never followed
    declared = TieringOffloadingSpec.build_metric_definitions(
        {"secondary_tiers": [{"type": "fs", "root_dir": str(root)}]})
    assert LINKS_REFUSED in declared
    seen = 0
    deadline = time.monotonic() + 10
    while seen < 1:  # the worker adds to its slot's counters as it answers
        data = e.manager.get_stats().data["data"]
        seen += data.get(LINKS_REFUSED, {}).get(("1:fs",), 0)
        assert time.monotonic() < deadline, data.keys()
        time.sleep(0.05)
    assert seen == 1
    assert data["vllm:kv_offload_tiering_promotion_job_failures"][("1:fs",)] == 1
    engine_id = e.spec.engine_id
    text = _top(engine_id)
    (line,) = [ln for ln in text.splitlines() if ln.startswith("tier 0  fs")]
    assert "links refused 1" in line, text
    (tier,) = json.loads(_top(engine_id, "--json"))["tiers"]
    assert tier["worker_counters"]["links_refused"] == 1
