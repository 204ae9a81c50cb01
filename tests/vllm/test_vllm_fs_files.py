"""Issue 12: a root shared with vLLM's own fs tier. vLLM's files (another format, in
vLLM's own directories) are never listed, probed as ours, served or removed; one
copied to where a shmtier chunk goes fails the frame checks and is a MISS."""

from __future__ import annotations

import mmap
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from fs_engine import HIT, MISS, engines, key  # noqa: E402,F401
from vllm.v1.kv_offload.base import ReqContext as VllmReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm_harness import offloading_config  # noqa: E402

from shmtier.contract import ReqContext  # noqa: E402
from shmtier.tiers.fs import scheduler as fs_tier  # noqa: E402

PAGE = 8192


def _vllm_fs_stores(root, keys) -> dict:
    """vLLM 0.33's FileSystemTierManager stores ``keys`` (random rows) under ``root``;
    its files: path -> bytes."""
    area = mmap.mmap(-1, len(keys) * PAGE)  # page-aligned rows, as vLLM's O_DIRECT needs
    rows = np.frombuffer(area, dtype=np.uint8).reshape(len(keys), PAGE)
    rows[:] = np.random.default_rng(1).integers(0, 256, rows.shape, dtype=np.uint8)
    spec = SimpleNamespace(config=offloading_config({}, "vllm-fs", kv_bytes_per_block=PAGE),
                           blocks_per_chunk=1,
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=False))
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "fs", "root_dir": str(root)}, memoryview(rows), spec)
    try:
        tier.submit_store(TransferJob(1, keys, np.arange(len(keys), dtype=np.int32), False,
                                      VllmReqContext("w")))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert result.success
    finally:
        tier.shutdown()  # (the anonymous mapping goes with its last view)
    files = {p: p.read_bytes() for p in root.rglob("*.bin")}
    assert len(files) == len(keys)
    return files


def test_vllm_fs_files_in_a_shared_root_are_never_listed_served_or_removed(engines, tmp_path):
    keys = [key(i) for i in range(4)]
    files = _vllm_fs_stores(tmp_path, keys)
    e = engines(tmp_path, page=PAGE)
    assert e.answers_settled(keys, ReqContext("r")) == [MISS] * 4  # listed: none; probed: none
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.bin")} == files  # untouched
    assert not list(tmp_path.rglob("*.kv"))


def test_a_vllm_file_where_a_shmtier_chunk_goes_is_a_miss(engines, tmp_path):
    keys = [key(i) for i in range(4)]
    vllm_bytes = next(iter(_vllm_fs_stores(tmp_path / "v", keys[:1]).values()))
    e = engines(tmp_path, page=PAGE, chunks=4)
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    e.offload([key(100 + i) for i in range(4)], 4, ReqContext("b"))  # keys leave the CPU tier
    e.settle()
    (ours,) = [p for p in tmp_path.rglob("*.kv") if p.name == keys[0].hex() + ".kv"]
    ours.write_bytes(vllm_bytes)  # an operator copied vLLM's file for the same key
    assert e.answers_settled(keys, ReqContext("r")) == [MISS, HIT, HIT, HIT]
    assert not ours.exists()  # failed the frame checks: removed, counted, never served
    data = e.manager.get_stats().data["data"]
    assert data[fs_tier.CORRUPT_CHUNKS][("1:fs",)] == 1
