"""Test helper: one engine with a ``p2p`` tier in its own process (multiprocessing spawn).

``serve(conn, engine_id, tier, layout)`` is the child's entry point: it builds an
``fs_engine.Engine`` (scheduler manager, a real segment, a fake GPU rank) with the p2p
tier options ``tier``, waits until the tier's endpoint runs and sends
``("ready", port)``. Then it answers commands (below) and, between them, steps the
engine (``on_schedule_end`` every few ms) so the tier serves its peers. Every command
answers ``("ok", value)`` or ``("error", text)``.

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
    import fs_engine
    from shmtier.contract import LookupResult, ReqContext
    from shmtier.tiers.p2p.requests import Request

    HIT, MISS = LookupResult.HIT, LookupResult.MISS
    engine = fs_engine.Engine(engine_id, None, tier_type="p2p", **layout, **tier)
    m = engine.manager
    p2p = m.tiers[0]
    slowest = [0.0]

    def timed(fn, *args):
        t0 = time.perf_counter()
        with m.lock:
            out = fn(*args)
        slowest[0] = max(slowest[0], time.perf_counter() - t0)
        return out

    def step():
        timed(m.on_schedule_end, fs_engine.END)

    def blocks(first, n):
        return [first + i * engine.bpc + j for i in range(n) for j in range(engine.bpc)]

    open_requests: dict = {}

    def produce(req_id, kvid, keys, first_block, finish=True):
        if isinstance(kvid, str):
            kvid = {"kv_request_id": kvid}
        ctx = ReqContext(req_id, None if kvid is None else {"remote_decoder": kvid})
        timed(m.on_new_request, ctx)
        open_requests[req_id] = ctx
        out = produce_more(req_id, keys, first_block)
        if finish:
            finish_request(req_id)
        return out

    def produce_more(req_id, keys, first_block):
        engine.offload([fs_engine.key(k) for k in keys], first_block, open_requests[req_id])
        step()
        return b"".join(c[blocks(first_block, len(keys))].numpy().tobytes()
                        for c in engine.caches)

    def finish_request(req_id):
        timed(m.on_request_finished, open_requests.pop(req_id))
        step()

    def consume(req_id, params, keys, first_block, timeout_s):
        (out,), slowest_s = consume_many([(req_id, params, keys, first_block)], timeout_s)
        return {**out, "slowest_call_s": slowest_s}

    def new_request(req_id, params, keys, first_block):
        ctx = ReqContext(req_id, params)
        timed(m.on_new_request, ctx)
        return {"ctx": ctx, "keys": [fs_engine.key(k) for k in keys], "first": first_block,
                "answers": [], "data": None, "done_s": None}

    held: dict = {}

    def look(req_id, params, keys, first_block, timeout_s):
        r = held[req_id] = new_request(req_id, params, keys, first_block)
        with m.lock:
            first = [m.lookup(k, r["ctx"]).name for k in r["keys"]]
        state = r["ctx"].get_state(Request)
        deadline = time.monotonic() + timeout_s
        while len(state.answers) < len(r["keys"]) and time.monotonic() < deadline:
            step()
            time.sleep(0.005)
        return {"first": first, "peer": [state.answers.get(k) for k in r["keys"]]}

    def resume(req_id, timeout_s):
        (out,), slowest_s = run([held.pop(req_id)], timeout_s)
        return {**out, "slowest_call_s": slowest_s}

    def consume_in_parts(req_id, params, keys, first_block, split, timeout_s):
        """One request whose keys are promoted in two jobs: ``keys[:split]`` looked up
        every step until HIT (loaded), then all of them (the rest is a second load of the
        same request), then its HITs loaded to the GPU."""
        r = new_request(req_id, params, keys, first_block)
        deadline = time.monotonic() + timeout_s
        for upto in (split, len(keys)):
            while True:
                with m.lock:
                    answers = [m.lookup(k, r["ctx"]) for k in r["keys"][:upto]]
                r["answers"].append([a.name for a in answers])
                if all(a is HIT or a is MISS for a in answers) or time.monotonic() > deadline:
                    break
                step()
                time.sleep(0.005)
        finish(r)
        step()
        return {"answers": r["answers"], "data": r["data"]}

    def consume_many(requests, timeout_s):
        """Several requests side by side, each looked up once per step until its answers
        are all HIT or MISS (then its leading HITs loaded and it finishes)."""
        return run([new_request(*r) for r in requests], timeout_s)

    def run(reqs, timeout_s):
        slowest[0] = 0.0
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        pending = list(reqs)
        while pending and time.monotonic() < deadline:
            for r in list(pending):
                t1 = time.perf_counter()
                with m.lock:
                    answers = [m.lookup(k, r["ctx"]) for k in r["keys"]]
                slowest[0] = max(slowest[0], time.perf_counter() - t1)
                r["answers"].append([a.name for a in answers])
                if all(a is HIT or a is MISS for a in answers):
                    finish(r)
                    r["done_s"] = time.monotonic() - t0
                    pending.remove(r)
            step()
            time.sleep(0.005)
        for r in pending:
            finish(r)
        step()
        return ([{k: r[k] for k in ("answers", "data", "done_s")} for r in reqs],
                slowest[0])

    def finish(r):
        keys, ctx, seen = r["keys"], r["ctx"], r["answers"]
        hits = 0
        while seen and hits < len(keys) and seen[-1][hits] == HIT.name:
            hits += 1
        if hits:
            with m.lock:
                spec = m.prepare_load(keys[:hits], ctx)
            gpu = blocks(r["first"], hits)
            engine.copy("load", spec, gpu)
            timed(m.complete_load, keys[:hits], ctx)
            r["data"] = b"".join(c[gpu].numpy().tobytes() for c in engine.caches)
        timed(m.on_request_finished, ctx)

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
        deadline = time.monotonic() + 30
        while not p2p.endpoint.ready:
            assert time.monotonic() < deadline, "p2p endpoint did not start"
            step()
            time.sleep(0.005)
        conn.send(("ready", p2p.port))
        while True:
            if not conn.poll(0.005):
                if not idle[0]:
                    step()
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
                    out = timed(m.has_pending_work)
                elif cmd[0] == "step":
                    step()
                    out = timed(m.has_pending_work)
                else:
                    raise ValueError(f"unknown command {cmd[0]!r}")
                conn.send(("ok", out))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        for r in held.values():  # looked up, never resumed
            timed(m.on_request_finished, r["ctx"])
        engine.close()
