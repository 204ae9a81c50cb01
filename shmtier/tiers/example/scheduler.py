"""``example``: an in-memory reference tier (for tests and as a template).

Unlike vLLM's example tier it really moves bytes: ``submit_store`` copies the
pinned primary rows into private memory, ``submit_load`` copies them back into
the reserved rows, so a promotion serves the exact bytes that were cascaded.
It does this synchronously inside the submit call, in the scheduler process,
which is fine for a reference tier and wrong for a real one (real tiers hand
the bytes to tier worker processes). No capacity limit, no eviction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from shmtier.contract import LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from shmtier.scheduler.tiering.base import JobResult, SecondaryTierManager, TransferJob
from shmtier.tiers.example.config import ExampleTierConfig


class ExampleSecondaryTierManager(SecondaryTierManager):
    medium = Medium.CPU

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, config: ExampleTierConfig | None = None):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = config if config is not None else ExampleTierConfig()
        self.custom_param = self.config.custom_param
        self._rows = np.asarray(primary_kv_view)
        self._data: dict[OffloadKey, bytes] = {}
        self._finished: list[JobResult] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self._data else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        for key, row in zip(job.keys, job.rows):
            if key not in self._data:
                self._data[key] = self._rows[row].tobytes()
        self._finished.append(JobResult(job.job_id, True, transfer_time=0.0,
                                        transfer_bytes=len(job.keys) * self.block_size_bytes))

    def submit_load(self, job: TransferJob) -> None:
        loaded = []
        for key, row in zip(job.keys, job.rows):
            data = self._data.get(key)
            if data is None:
                break
            self._rows[row] = np.frombuffer(data, dtype=np.uint8)
            loaded.append(key)
        ok = len(loaded) == len(job.keys)
        self._finished.append(JobResult(job.job_id, ok, None if ok else loaded, transfer_time=0.0,
                                        transfer_bytes=len(loaded) * self.block_size_bytes))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        return

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """Drop ``keys`` (tests: a chunk that vanished from the tier)."""
        for key in keys:
            self._data.pop(key, None)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("example_info",)

    def config_info(self) -> dict[str, Any]:
        return {"example_info": self.custom_param}

    def shutdown(self) -> None:
        self._rows = None
        self._data.clear()
