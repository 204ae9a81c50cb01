"""Cross-engine promotion GB/s of the p2p tier against raw ZeroMQ, and the scheduler's step time.

    .venv/bin/python -m bench.p2p_tier                  # 32 chunks of 1.4 MiB, 5 repeats (~1-2 min)
    .venv/bin/python -m bench.p2p_tier --quick          # smoke test: 8 chunks, 2 repeats, short step runs
    .venv/bin/python -m bench.p2p_tier --json bench/results/p2p_tier.json
    .venv/bin/python -m bench.p2p_tier --profile        # + cProfile of the consumer's scheduler process
    .venv/bin/python -m bench.p2p_tier --pin            # two hosts on one: producer / consumer on their own CPUs
    .venv/bin/python -m bench.p2p_tier --pin --only raw,pd,sym   # just these promotions (no step runs)

``--pin`` stands in for the two hosts of a real deployment: the producer engine (its
scheduler and endpoint) and the raw sender run on the last CPU, the consumer engine and the
raw receiver on the others, so the peer's work does not take the consumer's CPU (without it,
on this 2-CPU host every process shares both CPUs).

Method. Two engines per security mode (CurveZMQ with keys and allow-lists, the default;
and ``plaintext``), each in its own spawned process on 127.0.0.1: a scheduler (shmtier's
``TieringOffloadingSpec(...).get_manager()``, a real segment, a ``p2p`` tier and its
endpoint process); no GPU: the producer writes random bytes into the arena rows
``prepare_store`` gave it (standing in for the GPU copy), and every promoted row is
checked against the producer's (BLAKE2b of the chunks) after the timed region. The p2p
tier runs no tier workers: its I/O is the endpoint's (one thread per peer), so the
issue's "2 workers" does not apply.

- ``pd`` / ``pd+curve``: the producer stores a request of ``--chunks`` chunks with
  ``remote_decoder`` (parked); the consumer's request (``remote_prefiller``) looks its
  keys up (HIT, rows reserved), calls ``on_schedule_end`` (the load goes to the endpoint),
  then looks up again every millisecond until every key is HIT (loaded). Timed: first
  lookup to all HIT. ``fetch`` is the endpoint's own time for the fetch round.
- ``pd/8`` / ``pd/8+curve`` (``--split``): the same chunks as 8 PD requests of
  ``--chunks``/8 chunks, all arriving in the same step (a decoder taking several requests
  from one prefiller: their loads go to the peer side by side), timed from the first
  lookup until every key of every request is HIT.
- ``sym`` / ``sym+curve``: the producer holds the chunks in its CPU tier (no role); the
  consumer's request (``remote_kv_source``) looks up (RETRY until the peer has answered
  through its ParentManager, then HIT: rows reserved, load), timed the same way.
- ``raw`` / ``raw+curve``: bench/p2p_transport.py's raw measurement (``RawLoopback``, the
  same code): a DEALER sends the same number of chunks as single zero-copy frames to a
  ROUTER in another process, which answers after the last.

Every repeat runs each configuration once, in an order rotated per repeat; GB/s = chunk
bytes / seconds; tables show median [min-max] over the repeats.

Step time: the consumer engine runs scheduler steps (one every ``--step-ms``) in two modes,
interleaved ``--step-repeats`` times (CurveZMQ engines), each with the same requests
arriving alike: ``--steps`` // ``--arrive-every`` requests of ``--step-chunks`` chunks, one
arriving every ``--arrive-every`` steps (side by side with those still active), the run
ending when all are done. ``idle`` ("without a peer"): the p2p tier attached, its
endpoint running, the requests carry no ``kv_transfer_params`` (their lookups MISS at
once; no peer traffic). ``peer`` ("with a peer attached"): the same requests as PD
consumers (``remote_prefiller``) of the producer engine, which parks each request ahead
of it (at most ``STREAM_AHEAD`` at a time) in its own process on the same host (standing
in for the prefill host, at the scheduler's niceness); lookups HIT_PENDING until loaded,
then ``prepare_load``/``complete_load``. Both engines' endpoints run at the tier's default
``endpoint_niceness``; ``--nice0`` adds ``peer@nice0``: the same with both endpoints
reniced to 0 for that run (every thread). A step's time is the wall time of its manager
calls under ``manager.lock`` (lookups, loads, ``on_new_request`` /
``on_request_finished``, ``on_schedule_end``, ``has_pending_work``, ``get_stats``,
``take_events``), and its on-CPU part (``thread_time``); p50/p99 per run, median
[min-max] over runs; ``noload_p99``: the p99 of the steps in which no request's load
completed (``idle`` never loads).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import numpy as np

from bench.p2p_transport import RawLoopback, process_cpu_s
from shmtier.bench.common import exit_through_finally, fmt_mr, join_or_kill, med_range, pct, rotated, write_json
from shmtier.tiers.p2p.config import P2PTierConfig

IDLE_STEP_S = 0.005
STREAM_AHEAD = 3  # PD requests the producer keeps parked ahead of the consumer (step runs)


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def engine_proc(conn, engine_id: str, tier: dict, rows: int, chunk: int, profile: str | None,
                cpus: set | None = None):
    """One engine (scheduler + p2p tier) answering commands on ``conn``; steps every
    IDLE_STEP_S between them so its tier serves peers. ``cpus``: the CPUs this engine and
    the processes it starts (its endpoint) run on (``--pin``)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    import logging
    logging.basicConfig(level=logging.ERROR)
    from shmtier.config import KVLayout
    from shmtier.contract import LookupResult, ReqContext, ScheduleEndContext
    from shmtier.spec import TieringOffloadingSpec
    from shmtier.tiers.p2p.peer_metrics import FETCH_SECONDS

    HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
    END = ScheduleEndContext((), ())
    stride = -(-chunk // 4096) * 4096
    extra = {"cpu_bytes_to_use": rows * stride, "blocks_per_chunk": 1,
             "secondary_tiers": [{"type": "p2p", **tier}]}
    spec = TieringOffloadingSpec(extra, KVLayout("bench", "bfloat16", 16, chunk, 1), engine_id)
    m = spec.get_manager()
    p2p = m.tiers[0]
    arena = np.asarray(m.primary.get_kv_memoryview())
    # the bytes a producer "computes": rows of a random pool, each stamped with its key
    # (cheap, so the producer does not take the 2 cores from the others)
    pool = np.random.default_rng(abs(hash(engine_id)) % 2 ** 32).integers(
        0, 256, (16, chunk), dtype=np.uint8)
    nreq = iter(range(1, 1 << 30))
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()

    def step():
        with m.lock:
            m.on_schedule_end(END)

    def digest(row_ids) -> str:
        h = hashlib.blake2b(digest_size=16)
        for r in row_ids:
            h.update(arena[r, :chunk])
        return h.hexdigest()

    def produce(kvid, keys):
        keys = [_key(k) for k in keys]
        ctx = ReqContext(f"p{next(nreq)}", {"remote_decoder": {"kv_request_id": kvid}}
                         if kvid else None)
        with m.lock:
            m.on_new_request(ctx)
            out = m.prepare_store(keys, ctx)
        assert out is not None and out.keys_to_store == keys, "no rows to store into"
        row_ids = np.asarray(out.store_spec.block_ids).tolist()
        for i, (r, k) in enumerate(zip(row_ids, keys)):
            arena[r, :chunk] = pool[(i + k[31]) % len(pool)]
            arena[r, :len(k)] = np.frombuffer(k, np.uint8)
        with m.lock:
            m.complete_store(keys, ctx)
            m.on_request_finished(ctx)
        deadline = time.monotonic() + 30
        while True:  # parked (PD) or cascaded (no role: answered at once)
            step()
            with m.lock:  # (a consumer already waiting may have fetched them: released)
                parked = p2p._parked.get(kvid)
                parked = kvid in p2p._released or (parked and parked.rows >= len(keys))
                refs = [m.primary.ref_count(k) for k in keys]
            if parked if kvid else all(r == 0 for r in refs):
                break
            assert time.monotonic() < deadline, "stores not parked"
            time.sleep(0.001)
        return digest(row_ids)

    def promote(requests, timeout_s):
        """Promote ``requests`` ((params, keys) each) side by side: they arrive in the same
        step and are looked up every millisecond until all are HIT; timed from the first
        lookup. ``digest``: one per request."""
        reqs = [(ReqContext(f"c{next(nreq)}", params), [_key(k) for k in keys])
                for params, keys in requests]
        with m.lock:
            p2p.get_stats()  # drain: FETCH_SECONDS of this promotion only
        t0 = time.perf_counter()
        with m.lock:
            for ctx, _ in reqs:
                m.on_new_request(ctx)
        deadline = time.monotonic() + timeout_s
        located = None
        while True:
            with m.lock:
                answers = [m.lookup(k, ctx) for ctx, keys in reqs for k in keys]
                m.on_schedule_end(END)
            if located is None and RETRY not in answers:
                located = time.perf_counter() - t0
            if all(a is HIT for a in answers) or any(a is MISS for a in answers):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        seconds = time.perf_counter() - t0
        ok = all(a is HIT for a in answers)
        out = {"seconds": seconds, "ok": ok, "answers": sorted({a.name for a in answers}),
               "located_s": located if located is not None else seconds}
        with m.lock:
            loads = [m.prepare_load(keys, ctx) for ctx, keys in reqs] if ok else []
            fetch = p2p.get_stats().data["data"].get(FETCH_SECONDS, {})
        out["fetch_s"] = sum(fetch.values())  # (side by side: the loads' times summed)
        if ok:
            out["digest"] = [digest(np.asarray(load.block_ids).tolist()) for load in loads]
            with m.lock:
                for ctx, keys in reqs:
                    m.complete_load(keys, ctx)
        with m.lock:
            for ctx, _ in reqs:
                m.on_request_finished(ctx)
        step()
        return out

    def produce_stream(requests, ahead):
        """PD requests ``(kvid, keys)`` parked one after the other, at most ``ahead``
        parked at a time (a prefiller a little ahead of its decoder)."""
        for kvid, keys in requests:
            deadline = time.monotonic() + 60
            while len(p2p._parked) >= ahead:
                assert time.monotonic() < deadline, "the consumer fetches nothing"
                step()
                time.sleep(0.002)
            produce(kvid, keys)
        return len(requests)

    def renice(niceness):
        """Set every thread of this engine's endpoint process to ``niceness`` (an
        experiment: the tier's ``endpoint_niceness`` as if configured so)."""
        pid = p2p.endpoint.proc.pid
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        return pid

    def wait_unparked(timeout_s):
        deadline = time.monotonic() + timeout_s
        while p2p._parked:
            assert time.monotonic() < deadline, "parked chunks not released"
            step()
            time.sleep(0.002)
        return True

    def steps(requests, every, max_steps, period_s, profile_it=False):
        """Scheduler steps; ``requests``: (params, keys), request i arriving at step
        i * ``every`` (side by side with those still active), until all are done (at
        most ``max_steps``)."""
        todo = list(requests)
        times, cpu, loaded, done, hits = [], [], [], 0, 0
        active = []
        if prof and profile_it:
            prof.enable()
        for n in range(max_steps):
            if not active and not todo:
                break
            t_step, c_step = time.perf_counter(), time.thread_time()
            load = False
            with m.lock:
                if todo and n % every == 0:
                    params, keys = todo.pop(0)
                    active.append((ReqContext(f"s{next(nreq)}", params),
                                   [_key(k) for k in keys]))
                    m.on_new_request(active[-1][0])
                for req in list(active):
                    ctx, keys = req
                    answers = [m.lookup(k, ctx) for k in keys]
                    if all(a is HIT for a in answers):
                        m.prepare_load(keys, ctx)
                        m.complete_load(keys, ctx)
                        hits += len(keys)
                        load = True
                    if all(a is HIT or a is MISS for a in answers):
                        m.on_request_finished(ctx)
                        active.remove(req)
                        done += 1
                m.on_schedule_end(END)
                m.has_pending_work()
                m.get_stats()
                list(m.take_events())
            dt = time.perf_counter() - t_step
            times.append(dt)
            cpu.append(time.thread_time() - c_step)
            loaded.append(load)
            time.sleep(max(0.0, period_s - dt))
        if prof and profile_it:
            prof.disable()
        with m.lock:  # the cap was reached: end what is left (untimed)
            for ctx, _ in active:
                m.on_request_finished(ctx)
        return {"times": times, "cpu": cpu, "loaded": loaded, "requests_done": done,
                "hits": hits}

    try:
        deadline = time.monotonic() + 60
        while not p2p.endpoint.ready:
            assert time.monotonic() < deadline, "p2p endpoint did not start"
            step()
            time.sleep(0.005)
        conn.send(("ready", p2p.port))
        handlers = {"produce": produce, "promote": promote, "wait_unparked": wait_unparked,
                    "steps": steps, "produce_stream": produce_stream, "renice": renice,
                    "endpoint_cpu": lambda: process_cpu_s(p2p.endpoint.proc.pid)}
        while True:
            if not conn.poll(IDLE_STEP_S):
                step()
                continue
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            try:
                conn.send(("ok", handlers[cmd[0]](*cmd[1:])))
            except Exception as e:  # the bench reports it and stops
                import traceback
                conn.send(("error", f"{e}\n{traceback.format_exc()}"))
    finally:
        if prof and profile:
            prof.dump_stats(profile)
        m.shutdown()


class Engine:
    def __init__(self, ctx, engine_id, tier, rows, chunk, profile=None, cpus=None):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_proc, args=(child, engine_id, tier, rows, chunk,
                                                          profile, cpus), daemon=True)
        self.proc.start()
        child.close()
        self.port = None

    def ready(self) -> "Engine":
        if not self.conn.poll(120):
            raise RuntimeError("engine process did not start")
        tag, self.port = self.conn.recv()
        assert tag == "ready", self.port
        return self

    def call(self, *cmd, timeout_s: float = 300):
        self.conn.send(cmd)
        return self.result(cmd[0], timeout_s)

    def result(self, what: str, timeout_s: float = 300):
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"engine did not answer {what}")
        tag, value = self.conn.recv()
        if tag != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        join_or_kill([self.proc], 15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=32, help="chunks per promotion")
    ap.add_argument("--chunk-mib", type=float, default=1.4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--split", type=int, default=8,
                    help="pd/N: the same chunks as N PD requests side by side (1: not run)")
    ap.add_argument("--steps", type=int, default=600, help="steps per step-time run")
    ap.add_argument("--step-ms", type=float, default=10.0, help="step period")
    ap.add_argument("--step-chunks", type=int, default=4, help="chunks per PD request (steps)")
    ap.add_argument("--step-repeats", type=int, default=3, help="0: promotions only")
    ap.add_argument("--arrive-every", type=int, default=4,
                    help="a new request every this many steps (both step modes)")
    ap.add_argument("--nice0", action="store_true",
                    help="also a peer mode with both endpoints reniced to 0 (the scheduler's)")
    ap.add_argument("--quick", action="store_true", help="8 chunks, 2 repeats, 150 steps x 1")
    ap.add_argument("--pin", action="store_true",
                    help="two hosts on one: the producer engine (and its endpoint) on the last "
                         "CPU, the consumer engine (and its endpoint) on the others")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the consumer's peer step runs (bench/results/p2p_tier_steps.prof)")
    ap.add_argument("--only", help="comma-separated promotion configurations to run (of raw, "
                    "raw+curve, raw@nN, raw+curve@nN, pd, pd+curve, sym, sym+curve, pd/N, "
                    "pd/N+curve); the engines of a security mode none of them uses are not "
                    "started, and no step runs")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.chunks, args.repeats, args.steps, args.step_repeats = 8, 2, 150, 1
    if args.split < 1 or args.chunks % args.split:
        ap.error(f"--split {args.split}: must be >= 1 and divide --chunks {args.chunks}")
    ep_nice = P2PTierConfig(plaintext=True).endpoint_niceness  # added to the scheduler's
    all_names = ["raw", "raw+curve", f"raw@n{ep_nice}", f"raw+curve@n{ep_nice}",
                 "pd", "pd+curve", "sym", "sym+curve"] + (
        [f"pd/{args.split}", f"pd/{args.split}+curve"] if args.split > 1 else [])
    only = all_names
    if args.only:
        only = [n.strip() for n in args.only.split(",") if n.strip()]
        bad = [n for n in only if n not in all_names]
        if bad or not only:
            ap.error(f"--only {args.only!r}: {', '.join(bad) or 'nothing'} not among "
                     f"{', '.join(all_names)}")
        args.step_repeats = 0
    modes = {"curve" if n.endswith("curve") else "plain" for n in only if not n.startswith("raw")}
    if args.step_repeats:
        modes.add("curve")  # the step runs use the CurveZMQ engines
    exit_through_finally()

    import logging
    logging.basicConfig(level=logging.ERROR)
    import zmq
    from shmtier.tiers.p2p.keys import generate_keypair_files, load_keypair

    chunk = int(args.chunk_mib * 2 ** 20)
    total = chunk * args.chunks
    step_requests = max(1, args.steps // args.arrive_every)  # requests per step run
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="shmtier-p2p-tier-bench-")
    engines: list[Engine] = []
    raws: dict[str, RawLoopback] = {}
    try:
        for name in ("prod", "cons"):
            generate_keypair_files(os.path.join(tmp, name), name)
            os.makedirs(os.path.join(tmp, f"allow-{name}"))
        shutil.copy(os.path.join(tmp, "cons", "cons.key"), os.path.join(tmp, "allow-prod"))
        shutil.copy(os.path.join(tmp, "prod", "prod.key"), os.path.join(tmp, "allow-cons"))
        skeys = load_keypair(os.path.join(tmp, "prod", "prod.key_secret"))
        ckeys = load_keypair(os.path.join(tmp, "cons", "cons.key_secret"))
        common = {"host": "127.0.0.1", "port": 0, "fetch_timeout_s": 60,
                  "lookup_timeout_s": 60, "unbound_store_timeout_s": 600}

        def keyed(name):
            return {"secret_key_file": os.path.join(tmp, name, f"{name}.key_secret"),
                    "allow_keys_dir": os.path.join(tmp, f"allow-{name}")}

        rows_prod = max(args.chunks, args.step_chunks * STREAM_AHEAD) + 8
        rows_cons = max(args.chunks, args.step_chunks * 8) + 8  # requests side by side
        prof_path = None
        if args.profile:
            os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        exist_ok=True)
            prof_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     "p2p_tier_steps.prof")
        pid = os.getpid()
        pin_prod = pin_cons = None
        if args.pin:
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--pin needs 2 CPUs or more")
            pin_prod, pin_cons = {cpus[-1]}, set(cpus[:-1])
            print(f"pinned: producer on CPU {sorted(pin_prod)}, consumer on CPU {sorted(pin_cons)}")
        pairs = {}
        for mode, (pt, ct) in {"curve": (keyed("prod"), keyed("cons")),
                               "plain": ({"plaintext": True}, {"plaintext": True})}.items():
            if mode not in modes:
                continue
            prod = Engine(ctx, f"bench-p2p-{pid}-{mode}-p", {**common, **pt}, rows_prod, chunk,
                          cpus=pin_prod)
            cons = Engine(ctx, f"bench-p2p-{pid}-{mode}-c", {**common, **ct}, rows_cons, chunk,
                          prof_path if mode == "curve" else None, cpus=pin_cons)
            engines += [prod, cons]
            pairs[mode] = (prod, cons)
        for e in engines:
            e.ready()
        src = np.random.default_rng(7).integers(0, 256, (args.chunks, chunk), dtype=np.uint8)
        for name in [n for n in all_names[:4] if n in only]:
            raws[name] = RawLoopback(ctx, list(src), (skeys, ckeys) if "curve" in name else None,
                                     ep_nice if "@" in name else 0,
                                     peer_cpus=pin_cons, sender_cpus=pin_prod)
        for raw in raws.values():
            raw.run()  # warm-up: connection and handshake

        next_key = iter(range(1, 1 << 40))

        def promotion(mode: str, flow: str, split: int = 1) -> dict:
            """``split`` requests of ``--chunks`` / ``split`` chunks each, side by side."""
            prod, cons = pairs[mode]
            requests, want = [], []
            for _ in range(split):
                keys = [next(next_key) for _ in range(args.chunks // split)]
                kvid = f"kv-{keys[0]}"
                want.append(prod.call("produce", kvid if flow == "pd" else None, keys))
                role = "remote_prefiller" if flow == "pd" else "remote_kv_source"
                requests.append(({role: {"kv_request_id": kvid, "remote_host": "127.0.0.1",
                                         "remote_port": prod.port}}, keys))
            rx0 = cons.call("endpoint_cpu")
            cpu0 = prod.call("endpoint_cpu") + rx0
            got = cons.call("promote", requests, 120)
            rx = cons.call("endpoint_cpu")
            got["cpu_s"] = prod.call("endpoint_cpu") + rx - cpu0
            got["rx_cpu_s"] = rx - rx0
            if not got["ok"]:
                raise RuntimeError(f"{flow} {mode}: promotion failed: {got}")
            if got["digest"] != want:
                raise RuntimeError(f"{flow} {mode}: promoted bytes differ from the producer's")
            if flow == "pd":
                prod.call("wait_unparked", 30)
            return got

        for mode, flow in (("curve", "pd"), ("plain", "pd"), ("curve", "sym"), ("plain", "sym")):
            if mode in modes:
                promotion(mode, flow)  # warm-up: sessions, first rows
        names = [n for n in all_names if n in only]
        gbps = {n: [] for n in names}
        fetch_gbps = {n: [] for n in names if not n.startswith("raw")}
        cpu_s = {n: 0.0 for n in names}  # CPU of the moving processes, summed over repeats
        rx_cpu_s = {n: 0.0 for n in names}  # of the receiving one (raw peer, consumer endpoint)
        located_ms = {n: [] for n in names if not n.startswith("raw")}  # until no key is RETRY
        for rep in range(args.repeats):
            for name in rotated(names, rep):
                if name.startswith("raw"):
                    cpu0, rx0 = raws[name].cpu_s(), raws[name].receiver_cpu_s()
                    gbps[name].append(total / raws[name].run() / 1e9)
                    cpu_s[name] += raws[name].cpu_s() - cpu0
                    rx_cpu_s[name] += raws[name].receiver_cpu_s() - rx0
                    continue
                flow, _, sec = name.partition("+")
                flow, _, split = flow.partition("/")
                got = promotion("curve" if sec else "plain", flow, int(split or 1))
                gbps[name].append(total / got["seconds"] / 1e9)
                cpu_s[name] += got["cpu_s"]
                rx_cpu_s[name] += got["rx_cpu_s"]
                located_ms[name].append(got["located_s"] * 1e3)
                fetch_gbps[name].append(total / got["fetch_s"] / 1e9  # (pd/N: not one round)
                                        if got["fetch_s"] and not split else None)

        # step time: the same requests, arriving alike, without and with a peer (CurveZMQ)
        prod, cons = pairs.get("curve", (None, None))  # (--only: no step runs)
        kinds = ["idle", "peer"] + (["peer@nice0"] if args.nice0 else [])
        step_stats = {k: [] for k in kinds}
        step_info = {k: [] for k in kinds}
        step_len = {k: [] for k in kinds}
        period = args.step_ms / 1000
        default_nice = os.getpriority(os.PRIO_PROCESS, 0) + P2PTierConfig(plaintext=True).endpoint_niceness
        for rep in range(args.step_repeats):
            for kind in rotated(kinds, rep):
                for e in (prod, cons):  # the experiment's endpoints, or the default
                    e.call("renice", 0 if kind == "peer@nice0" else default_nice)
                if kind == "idle":  # no kv_transfer_params: its lookups MISS at once
                    reqs = [(None, [next(next_key) for _ in range(args.step_chunks)])
                            for _ in range(step_requests)]
                else:  # the producer parks them as the consumer fetches
                    stream = []
                    for _ in range(step_requests):
                        keys = [next(next_key) for _ in range(args.step_chunks)]
                        stream.append((f"kv-{keys[0]}", keys))
                    prod.conn.send(("produce_stream", stream, STREAM_AHEAD))
                    reqs = [({"remote_prefiller": {"kv_request_id": kvid,
                                                   "remote_host": "127.0.0.1",
                                                   "remote_port": prod.port}}, keys)
                            for kvid, keys in stream]
                # a run ends when its requests are done (the producer streams them)
                out = cons.call("steps", reqs, args.arrive_every, 8 * args.steps, period,
                                kind == "peer", timeout_s=600)
                if kind != "idle":
                    prod.result("produce_stream", 60)
                t = [x * 1e6 for x in out["times"]]
                c = [x * 1e6 for x in out["cpu"]]
                quiet = [x for x, load in zip(t, out["loaded"]) if not load]
                step_stats[kind].append({"p50": pct(t, 50), "p90": pct(t, 90),
                                         "p99": pct(t, 99), "max": max(t),
                                         "cpu_p50": pct(c, 50), "cpu_p99": pct(c, 99),
                                         "noload_p99": pct(quiet, 99)})
                step_info[kind].append({"requests": out["requests_done"], "hits": out["hits"]})
                step_len[kind].append(len(t))
                if kind != "idle":
                    prod.call("wait_unparked", 60)

        print(f"p2p tier loopback, 127.0.0.1, {args.chunks} chunks of {chunk} B "
              f"({args.chunk_mib} MiB) per promotion, {args.repeats} repeats, "
              f"{os.cpu_count()} CPUs, pyzmq {zmq.__version__} / libzmq {zmq.zmq_version()}")
        print(f"raw@n{ep_nice}: raw at the endpoints' niceness (+{ep_nice}); x: of raw with "
              f"the same security, at niceness 0 / at +{ep_nice}")
        print("cpu s/GB: CPU time of the processes that move the bytes (raw: sender and "
              "receiver; tier: both endpoint processes, every thread) per GB, all repeats; "
              "rx: of the receiving one alone (raw: the receiver; tier: the consumer's endpoint); "
              "located ms: from the first lookup until no key is RETRY (sym: the peer answered)")
        print("x raw/rep: the ratio to raw (same security, niceness 0) of each repeat's own "
              "raw figure (measured minutes apart at most), median [min-max]")
        print(f"{'method':<15} {'GB/s median [min-max]':>24} {'x raw / x raw@n':>18} "
              f"{'x raw/rep':>20} {'fetch round GB/s':>22} {'cpu s/GB':>9} {'rx':>5} "
              f"{'located ms':>18}")
        med = {k: med_range(v)[0] for k, v in gbps.items()}
        for name in names:
            base = "raw+curve" if name.endswith("curve") else "raw"
            ratio = "" if name.startswith("raw") else " / ".join(
                f"{med[name] / med[b]:.2f}x" if b in med else "-"
                for b in (base, f"{base}@n{ep_nice}"))
            per_rep = "" if name.startswith("raw") or base not in gbps else fmt_mr(med_range(
                [g / r for g, r in zip(gbps[name], gbps[base])]))
            fetch = fmt_mr(med_range(fetch_gbps[name])) if name in fetch_gbps else ""
            cpu = cpu_s[name] / (total * args.repeats / 1e9)
            rx = rx_cpu_s[name] / (total * args.repeats / 1e9)
            print(f"{name:<15} {fmt_mr(med_range(gbps[name])):>24} {ratio:>18} {per_rep:>20} "
                  f"{fetch:>22} {cpu:>9.2f} {rx:>5.2f} "
                  f"{fmt_mr(med_range(located_ms[name]), 1) if name in located_ms else '':>18}")
        if args.step_repeats:  # 0: promotions only
            print(f"\nconsumer scheduler step time (µs), a step every {args.step_ms:g} ms, "
                  f"{args.step_repeats} runs each, {step_requests} requests of "
                  f"{args.step_chunks} chunks, one arriving every {args.arrive_every} steps; "
                  f"idle: without kv_transfer_params (MISS), peer: PD from the producer "
                  f"(CurveZMQ; endpoints at niceness {default_nice}"
                  + (", peer@nice0: at 0" if args.nice0 else "") + "); steps/run: "
                  + ", ".join(f"{k} {'/'.join(str(len_) for len_ in step_len[k])}"
                              for k in kinds))
            cols = ("p50", "p90", "p99", "cpu_p50", "cpu_p99", "noload_p99")
            print(f"{'mode':<10} " + " ".join(f"{c:>19}" for c in cols) + f" {'requests/run':>14}")
            for kind in kinds:
                row = [fmt_mr(med_range([s[q] for s in step_stats[kind]]), 0) for q in cols]
                reqs = "/".join(str(i["requests"]) for i in step_info[kind])
                print(f"{kind:<10} " + " ".join(f"{r:>19}" for r in row) + f" {reqs:>14}")
            for q in ("p50", "p99", "cpu_p99", "noload_p99"):
                v = {k: med_range([s[q] for s in step_stats[k]])[0] for k in step_stats}
                for kind in kinds[1:]:
                    print(f"step {q} {kind} / idle: {v[kind] / v['idle']:.2f}x")
        if args.json:
            write_json(args.json, {"chunks": args.chunks, "chunk_bytes": chunk,
                                   "repeats": args.repeats, "gbps": gbps,
                                   "fetch_round_gbps": fetch_gbps, "cpu_s": cpu_s,
                                   "rx_cpu_s": rx_cpu_s,
                                   "located_ms": located_ms,
                                   "steps": step_stats,
                                   "step_runs": step_info, "step_ms": args.step_ms})
        if prof_path:
            print(f"cProfile of the consumer's step runs: {prof_path}")
    finally:
        for raw in raws.values():
            raw.close()
        for e in engines:
            try:
                e.conn.send(("stop",))
            except OSError:
                pass
        for e in engines:
            e.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
