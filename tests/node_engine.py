"""Test helper: one engine with a ``node`` tier in its own process (multiprocessing spawn),
as a data-parallel replica is: its own scheduler (spec manager), segment, tier workers and
fake GPU rank (``fs_engine.Engine``), calls through the connector driver.

``serve(conn, engine_id, tier, layout)`` is the child's entry point: it builds the engine
with the node tier options ``tier`` and sends ``("ready", pid)``. Then it answers commands,
each with ``("ok", value)`` or ``("error", text)``:

- ``("offload", req_id, keys, first_block)``: a request stores chunks ``keys`` (ints, see
  ``fs_engine.key``) from GPU blocks ``first_block...`` and finishes; the engine steps until
  its cascades are done; value: the GPU bytes of those blocks (all ranks).
- ``("consume", req_id, keys, first_block[, timeout_s])``: a request looks ``keys`` up once
  per step until no answer is deferred, loads its leading hits into GPU blocks
  ``first_block...`` (zeroed first) and finishes; value: ``{"answers": [names per step],
  "data": the GPU bytes of the loaded blocks}``.
- ``("workers",)``: the pids of its tier worker processes; ``("guardian",)``: its segment
  guardian's.
- ``("metrics",)``: the tier's counters so far, ``{name: value}`` summed over labels.
- ``("stop",)``: shut down (the manager's shutdown: the tier detaches from the pool).
"""

from __future__ import annotations

import traceback


def serve(conn, engine_id: str, tier: dict, layout: dict) -> None:
    import fs_engine
    from shmtier.connector_driver import Lookup

    engine = fs_engine.Engine(engine_id, None, tier_type="node", **layout, **tier)
    d = engine.driver
    seen: dict = {}

    def blocks(first, n):
        return [first + i * engine.bpc + j for i in range(n) for j in range(engine.bpc)]

    def gpu_bytes(gpu):
        return b"".join(c[gpu].numpy().tobytes() for c in engine.caches)

    def offload(req_id, keys, first_block):
        ctx = d.open(req_id, [fs_engine.key(k) for k in keys])
        engine.offload([fs_engine.key(k) for k in keys], first_block, ctx)
        d.close(ctx)
        engine.settle()
        return gpu_bytes(blocks(first_block, len(keys)))

    def consume(req_id, keys, first_block, timeout_s=30.0):
        r = Lookup([fs_engine.key(k) for k in keys], d.open(req_id))
        assert d.until([r], timeout_s=timeout_s, load=True), f"{req_id}: lookups never final"
        gpu = blocks(first_block, len(r.hits))

        def copy(spec, hits):
            for cache in engine.caches:
                cache[gpu] = 0
            engine.copy("load", spec, gpu)

        d.complete(r, copy)
        d.close(r.ctx)
        return {"answers": [[a.name for a in step] for step in r.answers],
                "data": gpu_bytes(gpu) if r.hits else b""}

    def metrics():
        with engine.manager.lock:
            data = engine.manager.tiers[0].get_stats().data
        for name, values in data["data"].items():
            if data["types"][name] != "counter":
                continue
            seen[name] = seen.get(name, 0) + sum(values.values())
        return dict(seen)

    commands = {"offload": offload, "consume": consume, "metrics": metrics,
                "workers": lambda: [p.pid for p in engine.spec.worker_pool._procs if p],
                "guardian": lambda: engine.manager.primary.segment.guardian.pid}
    try:
        conn.send(("ready", None))
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            if cmd[0] == "stop":
                return
            try:
                conn.send(("ok", commands[cmd[0]](*cmd[1:])))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        engine.close()
