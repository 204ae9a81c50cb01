"""Test helper: one engine with a ``p2p`` tier in its own process (multiprocessing spawn).

``serve(conn, engine_id, tier, layout)`` is the child's entry point: it builds an
``fs_engine.Engine`` (scheduler manager, a real segment, a fake GPU rank) with the p2p
tier options ``tier``, waits until the tier's endpoint runs and sends
``("ready", port)``. Then it answers commands (below) and, between them, steps the
engine (``on_schedule_end`` every few ms) so the tier serves its peers. Every command
answers ``("ok", value)`` or ``("error", text)``. The manager is called through the
engine's connector driver (shmtier/connector_driver.py): a consumer's loads are prepared in
the step its answers are final, as vLLM's connector does.

- ``("produce", req_id, kvid, keys, first_block[, finish])``: a PD prefiller request
  (``remote_decoder``: ``{"kv_request_id": kvid}``, or ``kvid`` itself when it is a dict;
  a plain request if ``kvid`` is None) stores chunks ``keys`` from GPU blocks
  ``first_block...`` and finishes (unless ``finish`` is False: then ``("produce_more",
  req_id, keys, first_block)`` stores more of it and ``("finish", req_id)`` finishes it);
  value: the GPU bytes of those blocks.
- ``("consume", req_id, params, keys, first_block, timeout_s)``: a request with
  ``kv_transfer_params`` ``params`` looks ``keys`` up once per step until every answer is
  HIT or MISS (then loads the leading HITs into GPU blocks ``first_block...``), or the
  timeout; value: ``{"answers": [per step], "data": bytes or None, "slowest_call_s"}``.
- ``("consume_many", [(req_id, params, keys, first_block), ...], timeout_s)``: those
  requests side by side (each as ``consume``; the steps are shared); value:
  ``{"requests": [{"answers", "data", "done_s": seconds from the start until its answers
  were final, or None}], "slowest_call_s"}``.
- ``("look", req_id, params, keys, first_block, timeout_s)``: a symmetric consumer's
  request (``remote_kv_source``) looks ``keys`` up once, then the engine only steps
  until the tier has the peer's answer for every key (or the timeout), and holds the
  request there: no second lookup, so no promotion starts and the peer keeps the rows it
  parked for it; value: ``{"first": [answers], "peer": [the peer's bool per key]}``.
  ``("resume", req_id, timeout_s)`` then goes on as ``consume`` (lookups per step, the
  load, finish); value: as ``consume``'s.
- ``("refs", keys)``: the primary's ref count of each key (pins; None: not resident).
- ``("stats",)``: the tier's endpoint counters, parked rows, restarts, pid of endpoint,
  and ``metrics``: the tier's counters so far (``get_stats``), ``{short name: {labels
  joined by ",": value}}`` (short name: after ``p2p_``); the engine's ``fingerprint`` and
  ``hash_seed`` (what a peer's hello must carry).
- ``("idle", flag)``: stop (True) or resume (False) the steps between commands, as an
  engine vLLM has nothing to step for; value: ``has_pending_work()`` (vLLM steps an
  engine with no request while it is True). ``("step",)``: one step; value: the same.
- ``("stop",)``.
"""

from __future__ import annotations

import time
import traceback


def serve(conn, engine_id: str, tier: dict, layout: dict) -> None:
    from dataclasses import dataclass

    import fs_engine
    from shmtier.connector_driver import Lookup, Meter
    from shmtier.tiers.p2p.requests import Request

    engine = fs_engine.Engine(engine_id, None, tier_type="p2p", **layout, **tier)
    m, d = engine.manager, engine.driver
    p2p = m.tiers[0]

    class Slowest(Meter):
        """The slowest timed region (a manager call or a wait for its lock) since reset."""

        seconds = 0.0

        def end(self, token, kind, calls, keys, wall_ns, cpu_ns):
            self.seconds = max(self.seconds, wall_ns / 1e9)

    slowest = Slowest()
    d.measure(slowest)

    @dataclass(eq=False)
    class Consumer(Lookup):
        first: int = 0  # its first GPU block
        data: bytes | None = None  # the GPU bytes it loaded
        done_s: float | None = None  # seconds from the start until its answers were final

        def out(self):
            return {"answers": [[a.name for a in step] for step in self.answers],
                    "data": self.data, "done_s": self.done_s}

    def blocks(first, n):
        return [first + i * engine.bpc + j for i in range(n) for j in range(engine.bpc)]

    open_requests: dict = {}

    def produce(req_id, kvid, keys, first_block, finish=True):
        if isinstance(kvid, str):
            kvid = {"kv_request_id": kvid}
        params = None if kvid is None else {"remote_decoder": kvid}
        open_requests[req_id] = d.open(req_id, params=params)
        out = produce_more(req_id, keys, first_block)
        if finish:
            finish_request(req_id)
        return out

    def produce_more(req_id, keys, first_block):
        engine.offload([fs_engine.key(k) for k in keys], first_block, open_requests[req_id])
        d.step()
        return b"".join(c[blocks(first_block, len(keys))].numpy().tobytes()
                        for c in engine.caches)

    def finish_request(req_id):
        d.close(open_requests.pop(req_id))

    def consume(req_id, params, keys, first_block, timeout_s):
        (out,), slowest_s = consume_many([(req_id, params, keys, first_block)], timeout_s)
        return {**out, "slowest_call_s": slowest_s}

    def new_request(req_id, params, keys, first_block):
        return Consumer([fs_engine.key(k) for k in keys], d.open(req_id, params=params),
                        first=first_block)

    held: dict = {}

    def look(req_id, params, keys, first_block, timeout_s):
        r = held[req_id] = new_request(req_id, params, keys, first_block)
        with d.locked():
            first = [a.name for a in d.lookup_each(r.keys, r.ctx)]
        state = r.ctx.get_state(Request)
        d.step_until(lambda: len(state.answers) >= len(r.keys), timeout_s=timeout_s)
        return {"first": first, "peer": [state.answers.get(k) for k in r.keys]}

    def resume(req_id, timeout_s):
        (out,), slowest_s = run([held.pop(req_id)], timeout_s)
        return {**out, "slowest_call_s": slowest_s}

    def consume_in_parts(req_id, params, keys, first_block, split, timeout_s):
        """One request whose keys are promoted in two jobs: ``keys[:split]`` looked up
        every step until HIT or MISS (promoted), then all of them (the rest is a second
        promotion of the same request), then its HITs loaded to the GPU."""
        r = new_request(req_id, params, keys, first_block)
        deadline = time.monotonic() + timeout_s
        part = Lookup(r.keys[:split], r.ctx, answers=r.answers)
        d.until([part], timeout_s=deadline - time.monotonic())
        d.until([r], timeout_s=deadline - time.monotonic(), load=True)
        finish(r)
        d.step()
        return {"answers": r.out()["answers"], "data": r.data}

    def consume_many(requests, timeout_s):
        """Several requests side by side, each looked up once per step until its answers
        are all HIT or MISS (then its leading HITs loaded and it finishes)."""
        return run([new_request(*r) for r in requests], timeout_s)

    def run(reqs, timeout_s):
        slowest.seconds = 0.0
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        pending = list(reqs)
        while pending and time.monotonic() < deadline:
            for r in d.look_step(pending, load=True):
                finish(r)
                r.done_s = time.monotonic() - t0
                pending.remove(r)
            time.sleep(0.005)
        for r in pending:
            finish(r)
        d.step()
        return [r.out() for r in reqs], slowest.seconds

    def finish(r):
        """Load ``r``'s hits (prepared in its final step; one that timed out: the leading
        HITs of its last answers) into its GPU blocks, and finish it."""
        if not r.final and r.answers and d.leading_hits(r.answers[-1]):
            r.hits = r.keys[:d.leading_hits(r.answers[-1])]
            with d.locked():
                r.load = d.prepare_load(r.hits, r.ctx)

        def copy(spec, hits):
            gpu = blocks(r.first, len(hits))
            engine.copy("load", spec, gpu)
            r.data = b"".join(c[gpu].numpy().tobytes() for c in engine.caches)

        d.complete(r, copy)
        with d.locked():
            d.finish(r.ctx)

    metrics_seen: dict = {}
    idle = [False]  # True: no step unless asked (an engine vLLM has nothing to step for)

    def stats():
        proc = p2p.endpoint.proc
        with m.lock:
            data = p2p.get_stats().data["data"]
        for name, values in data.items():
            if name.endswith("parked_rows"):  # a gauge
                continue
            for labels, v in values.items():
                per = metrics_seen.setdefault(name.rpartition("p2p_")[2], {})
                per[",".join(labels)] = per.get(",".join(labels), 0) + v
        return {"counters": p2p.metrics.endpoint_counters, "metrics": metrics_seen,
                "parked": sum(p.rows for p in p2p._parked.values()),
                "restarts": p2p.endpoint.restarts, "pid": proc.pid if proc else None,
                "port": p2p.port, "tmpdir": p2p.endpoint.tmpdir, "fingerprint": p2p._fingerprint,
                "hash_seed": p2p.config.effective_hash_seed()}

    try:
        assert d.step_until(lambda: p2p.endpoint.ready, timeout_s=30), "p2p endpoint did not start"
        conn.send(("ready", p2p.port))
        while True:
            if not conn.poll(0.005):
                if not idle[0]:
                    d.step()
                continue
            try:
                cmd = conn.recv()
            except EOFError:
                return
            if cmd[0] == "stop":
                return
            try:
                if cmd[0] == "produce":
                    out = produce(*cmd[1:])
                elif cmd[0] == "produce_more":
                    out = produce_more(*cmd[1:])
                elif cmd[0] == "finish":
                    out = finish_request(*cmd[1:])
                elif cmd[0] == "consume":
                    out = consume(*cmd[1:])
                elif cmd[0] == "consume_in_parts":
                    out = consume_in_parts(*cmd[1:])
                elif cmd[0] == "look":
                    out = look(*cmd[1:])
                elif cmd[0] == "resume":
                    out = resume(*cmd[1:])
                elif cmd[0] == "consume_many":
                    out, slowest_s = consume_many(*cmd[1:])
                    out = {"requests": out, "slowest_call_s": slowest_s}
                elif cmd[0] == "refs":
                    with m.lock:
                        out = [m.primary.ref_count(fs_engine.key(k)) for k in cmd[1]]
                elif cmd[0] == "stats":
                    out = stats()
                elif cmd[0] == "idle":  # stop (True) or resume (False) stepping when idle
                    idle[0] = cmd[1]
                    with d.locked():
                        out = d.has_pending_work()
                elif cmd[0] == "step":
                    d.step()
                    with d.locked():
                        out = d.has_pending_work()
                else:
                    raise ValueError(f"unknown command {cmd[0]!r}")
                conn.send(("ok", out))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        for r in held.values():  # looked up, never resumed
            with d.locked():
                d.finish(r.ctx)
        engine.close()
