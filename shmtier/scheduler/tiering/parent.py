"""The tiering manager as one tier sees it when it serves external requests (a peer's
lookups and fetches: ``serve_external_requests(parent)``): every fan-out leaves the
serving tier out, and the store jobs it creates are its own.

Who calls: a tier's ``serve_external_requests``, in the scheduler process, under the
manager's lock (the step, or the tier-poll thread). Each call is the manager's own.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from shmtier.contract import LookupResult, OffloadKey, ReqContext, RequestOffloadingContext
from shmtier.scheduler.tiering.base import ParentManager, TransferJob


class TierFacingParent(ParentManager):
    """The manager as seen by tier ``origin`` in ``serve_external_requests``:
    every fan-out skips the origin tier; store jobs it creates are its own."""

    def __init__(self, manager: Any, origin: int):
        self._manager = manager
        self._origin = origin

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self._manager.on_new_request(req_context, exclude_tier_idx=self._origin)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._manager.lookup(key, req_context, exclude_tier_idx=self._origin)

    def create_store_job(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TransferJob:
        return self._manager._create_store_job(keys, req_context, self._origin)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._manager.on_request_finished(req_context, exclude_tier_idx=self._origin)
