"""The connector's call sequences that tests drive a manager with, in one place."""

from __future__ import annotations


def offload(manager, keys, ctx, copy):
    """The connector's store path: prepare_store (which must not refuse), the GPU ->
    arena copy of the keys it returned (``copy(out)``, skipped when there are none),
    complete_store. Returns prepare_store's output."""
    with manager.lock:
        out = manager.prepare_store(keys, ctx)
    assert out is not None
    if out.keys_to_store:
        copy(out)
        with manager.lock:
            manager.complete_store(out.keys_to_store, ctx)
    return out
