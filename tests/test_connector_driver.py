"""The connector driver (shmtier/connector_driver.py) calls a manager in vLLM's connector
order and lock regions (docs/vllm-contract.md §2.2-2.3), over shmtier's CPU manager."""

from __future__ import annotations

from shmtier.connector_driver import LOCK_WAIT, ConnectorDriver, Lookup, Meter
from shmtier.contract import CacheHitSource, LookupResult
from shmtier.scheduler.primary import CPUOffloadingManager
from shmtier.shared.chunk_table import ChunkTable

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
LW = "|"  # a lock region starts


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


class Record(Meter):
    """Each region's kind (LW for a wait for the lock), and the calls in each."""

    def __init__(self, seen: list):
        self.seen = seen
        self.calls: dict[str, int] = {}

    def end(self, token, kind, calls, keys, wall_ns, cpu_ns):
        assert wall_ns >= 0 and cpu_ns >= 0
        self.seen.append(LW if kind == LOCK_WAIT else kind)
        self.calls[kind] = self.calls.get(kind, 0) + calls


def driver(rows=8):
    """A driver over a CPU manager of ``rows`` rows, the regions it times, their meter."""
    seen: list = []
    meter = Record(seen)
    manager = CPUOffloadingManager(ChunkTable.private(rows, 40), "lru", enable_events=True)
    return ConnectorDriver(manager, meter=meter), seen, meter


def test_a_request_plays_in_the_connectors_order_and_lock_regions():
    d, seen, meter = driver()
    d.play("first", [key(i) for i in range(3)], known=0)
    seen.clear()
    keys = [key(i) for i in range(5)]  # 0-2 stored, 3-4 new
    played = d.play("second", keys,
                    copy_load=lambda spec, hits: seen.append(("copy load", hits)),
                    copy_store=lambda out: seen.append(("copy store", out.keys_to_store)))
    assert seen == [
        LW, "on_new_request",  # add_request: a short region
        LW, "lookup", "prepare_load", "get_load_source", "prepare_store", "on_schedule_end",
        ("copy load", keys[:3]), ("copy store", keys[3:]),  # the GPU workers, no lock
        LW, "complete_load", "complete_store",  # update_connector_output
        LW, "on_request_finished", "on_schedule_end",  # the request finishes in a step
    ]
    assert meter.calls["lookup"] == 4  # the scan stopped at key 3's MISS
    assert played.answers == [HIT, HIT, HIT, MISS] and played.hits == keys[:3]
    assert played.sources == [CacheHitSource.HOST] * 3
    assert played.store.keys_to_store == keys[3:] and played.deferred_steps == 0
    hooks = d.engine_hooks()
    assert seen[-6:] == [LW, "has_pending_work", LW, "get_stats", LW, "take_events"]
    assert hooks.pending is False
    assert [e.keys for e in hooks.events if not e.removed] == [keys[:3], keys[3:]]


def test_a_deferred_request_waits_a_step_and_loads_what_is_readable_then():
    d, seen, _ = driver()
    writer = d.open("writer", [key(0)])
    with d.locked():
        pending = d.prepare_store([key(0)], writer)  # its copy not done: HIT_PENDING
    steps = []

    def next_step():  # the writer's copy completes between the steps
        steps.append(list(seen))
        d.complete_jobs([(True, pending.keys_to_store, writer)])

    seen.clear()
    played = d.play("reader", [key(0), key(1)], known=2, offer=(), on_deferred=next_step)
    assert played.deferred_steps == 1 and played.hits == [key(0)]
    assert steps == [[LW, "on_new_request", LW, "lookup", "on_schedule_end"]]
    assert "prepare_store" not in seen  # nothing offered


def test_scan_stops_at_the_first_miss_and_lookup_each_asks_every_key():
    d, _, _ = driver()
    d.play("w", [key(0), key(2)], known=0)
    keys = [key(0), key(1), key(2)]
    with d.locked():
        ctx = d.new_request("r", keys)
        assert d.scan(keys, ctx) == [HIT, MISS]
        assert d.scan(keys, ctx, 2) == [HIT]
        assert d.lookup_each(keys, ctx) == [HIT, MISS, HIT]
        d.finish(ctx)
        d.end_step()


def test_until_steps_until_each_request_is_final_or_the_timeout():
    d, _, _ = driver()
    ctx = d.open("w", [key(0)])
    with d.locked():
        pending = d.prepare_store([key(0)], ctx)
    req = Lookup([key(0)], d.open("r"))
    assert d.until([req], timeout_s=0.05, sleep_s=0.01) is False  # never completed
    assert len(req.answers) >= 2 and all(a == [PENDING] for a in req.answers)
    d.complete_jobs([(True, pending.keys_to_store, ctx)])
    assert d.until([req], timeout_s=5, load=True) is True
    assert req.answers[-1] == [HIT] and req.hits == [key(0)] and req.load is not None
    d.complete(req)
    d.close(req.ctx)
    assert d.settle(5) == 1  # nothing pending: one idle step
