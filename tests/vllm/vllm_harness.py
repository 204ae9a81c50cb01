"""What the vLLM conformance tests share: vLLM's normalized ``OffloadingConfig``
for a tiny one-group model, and vLLM's own Prometheus front end over a private
registry. Imports vLLM: a test module imports this after its
``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

import dataclasses
import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)


def _model_config(name: str, dtype: str, max_model_len: int) -> OffloadingModelConfig:
    """vLLM's model config; 0.32's has no ``max_model_len``."""
    names = {f.name for f in dataclasses.fields(OffloadingModelConfig)}
    extra = {"max_model_len": max_model_len} if "max_model_len" in names else {}
    return OffloadingModelConfig(name, dtype, **extra)


def offloading_config(extra, engine_id, *, layers=("layer.0", "layer.1"), kv_bytes_per_block=2048,
                      dtype="float16", rank=0, world_size=1, pp=1, bpc=1, events=True,
                      replicated=False, canonical=False, max_model_len=512) -> OffloadingConfig:
    """vLLM's normalized config as build_offloading_config makes it for a one-group
    full-attention model (``layers``, ``kv_bytes_per_block`` of one worker per GPU
    block) with 16-token GPU blocks."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, tuple(layers), 0),),
        worker_kv_bytes_per_block=kv_bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=engine_id,
        model=_model_config("tiny-llama", dtype, max_model_len),
        cache=OffloadingCacheConfig(16, bpc),
        parallel=OffloadingParallelConfig(rank, world_size, world_size // pp, pp, 1, 1, 0, 1,
                                          None, True),
        replicated_layout=replicated,
        canonical_layout=canonical,
    )


def connector_vllm_config(extra) -> VllmConfig:
    """The engine config of an OffloadingConnector (both roles, CPU) with ``extra``
    as its kv_connector_extra_config."""
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                            kv_role="kv_both", kv_connector_extra_config=extra),
        device_config=DeviceConfig(device="cpu"))


def prom_front_end(vllm_config) -> tuple[CollectorRegistry, OffloadPromMetrics]:
    """vLLM's Prometheus front end for one engine (engine 0, model "m") of
    ``vllm_config``, its metrics in a registry of their own."""
    registry = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = OffloadPromMetrics(vllm_config, kinds, ["model_name", "engine"], {0: ["m", "0"]})
    return registry, prom
