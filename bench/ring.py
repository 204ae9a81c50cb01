#!/usr/bin/env python
"""Job rings vs multiprocessing.Queue: throughput, wake latency, idle CPU (docs/design.md §4, §11).

Run from a checkout::

    .venv/bin/python -m bench.ring            # 10^6 jobs x 3 runs per transport (~3 min)
    .venv/bin/python -m bench.ring --quick    # 10^5 jobs (~30 s)
    .venv/bin/python -m bench.ring --json bench/results/ring.json

Topology: this process is the producer (the scheduler's role); 2 consumer
processes (spawned, the tier workers' role). Each job is a real descriptor
(``pack_job``: op store, 4 keys of 40 bytes, 4 rows, ~190 bytes) encoded in the
producer's loop and decoded (``decode_job``) by the consumer, so the figures
include what a job costs end to end in Python. Transports, same job stream,
same run, interleaved per repeat:

* ``ring``     - one SPSC job ring per consumer in a real segment
                 (``RingSet``); job i goes to ring i % 2, to the other if full,
                 and the producer sleeps 100 µs when both are full
                 (backpressure; counted). Consumers drain with ``get_many``.
* ``mpq-2``    - one ``multiprocessing.Queue`` per consumer (same topology).
* ``mpq-1``    - one shared ``multiprocessing.Queue`` for both consumers.

Figures:

* jobs/s: N / (time the last job was received - time the first was put);
  median of the runs and [min-max]; exactly-once is checked on every run
  (each consumer marks the ids it got; every id must be marked exactly once).
* CPU µs per job: producer and consumers (process CPU time over the run / N).
* wake latency: one job at a time with 1-3 ms idle gaps (consumer asleep);
  from the producer's timestamp (taken just before encoding) to the consumer's
  return from its wait; p50 / p99 / max.
* floor: the same wake measurement on a bare POSIX semaphore (timestamp in a
  shared word, no encode, no ring), and the idle CPU of a process that only
  loops on time.sleep(1 s): what a wake-up costs on this machine right now, to
  read the other figures against (here one wake after a second asleep costs
  0.2-5 ms of CPU: cold caches on a shared VM).
* idle CPU: consumers waiting with nothing to do for 2 s, in their normal
  loop (``get_many(timeout=1 s)`` / ``Queue.get(timeout=1 s)``, waking once a
  second to beat); on-CPU time from /proc/<pid>/schedstat, % of one core, and
  voluntary sleeps per second (/proc/<pid>/status) to show how often they woke.

The segment and its semaphores are removed on exit, also on error and SIGTERM.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import random
import statistics
import sys
import time

import numpy as np
import posix_ipc

from shmtier.bench.common import exit_through_finally, med_range, rotated, write_json

from shmtier.shared.jobs import decode_job, pack_job
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.ring import RingSet, ring_area_nbytes, semaphore_name
from shmtier.shared.segment import open_segment

CTX = mp.get_context("spawn")
GEOMETRY = ArenaGeometry(num_chunks=1, row_stride=4096, page_size_per_worker=4096, world_size=1)
FP = "bench-ring"
CONSUMERS = 2
TRANSPORTS = ("ring", "mpq-2", "mpq-1")
KEY_POOL = 4096
STOP_ID = (1 << 63)


# --- consumer processes ---

class _RingSource:
    def __init__(self, engine_id, index, rings_len):
        self.seg = open_segment(engine_id, GEOMETRY, FP, owner=False, rings_len=rings_len,
                                prefault=False, timeout_s=30)
        self.rs = RingSet.attach(self.seg.name, self.seg.rings, worker=index, timeout_s=30)
        self.worker = self.rs.worker(index)
        self.worker.claim()
        self.ring = self.worker.jobs

    def batches(self, batch):
        get_many, beat = self.ring.get_many, self.worker.beat
        while True:
            got = get_many(batch, 1.0)
            if got:
                yield got
            elif not self.rs.owner_alive():
                return  # the producer died: a worker exits (docs/design.md §8)
            else:
                beat()

    def close(self):
        self.worker.unclaim()
        self.rs.close()
        self.seg.close()


class _QueueSource:
    def __init__(self, q):
        self.q = q
        self.parent = os.getppid()

    def batches(self, batch):
        get = self.q.get
        while True:
            try:
                yield (get(timeout=1.0),)
            except queue_mod.Empty:
                if os.getppid() != self.parent:
                    return  # the producer died

    def close(self):
        pass


def _consumer(kind, source_args, n, latency, conn):
    """Child: take jobs until a stop job, then report (seen ids or latencies, CPU, last time)."""
    source = _RingSource(*source_args) if kind == "ring" else _QueueSource(*source_args)
    try:
        conn.send("ready")
        seen = bytearray(n) if not latency else None
        lat = []
        last = 0.0
        cpu0 = time.process_time()
        for batch in source.batches(64):
            now_ns = time.perf_counter_ns()
            stop = False
            for raw in batch:
                job = decode_job(raw)
                if job.job_id >= STOP_ID:
                    stop = True
                elif latency:
                    lat.append(now_ns - job.args["t"])
                else:
                    seen[job.job_id] += 1
            last = time.perf_counter()
            if stop:
                break
        conn.send({"seen": bytes(seen) if seen is not None else b"", "lat": lat, "last": last,
                   "cpu": time.process_time() - cpu0})
    finally:
        source.close()


def _floor_consumer(engine_id, rings_len, sem_name, samples, conn):
    """Child: the wake-up floor - sleep on a bare semaphore, read a timestamp from the arena."""
    seg = open_segment(engine_id, GEOMETRY, FP, owner=False, rings_len=rings_len,
                       prefault=False, timeout_s=30)
    sem = posix_ipc.Semaphore(sem_name)
    stamp = seg.arena[:8].cast("q")
    try:
        conn.send("ready")
        lat = []
        for _ in range(samples):
            sem.acquire(1.0 + 60)
            lat.append(time.perf_counter_ns() - stamp[0])
        conn.send(lat)
    finally:
        stamp.release()
        sem.close()
        seg.close()


def _sleeper(conn):
    """Child: the idle floor - a loop of time.sleep(1 s), nothing else."""
    conn.send("ready")
    while not conn.poll():
        time.sleep(1.0)


# --- producer side ---

def _cpu_ns(pid):
    """Nanoseconds ``pid`` has run on a CPU (/proc/<pid>/schedstat; ns resolution)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def _wakeups(pid):
    """Voluntary context switches of ``pid`` (each one a sleep, so a later wake-up)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


class Bench:
    def __init__(self, args, engine_id):
        self.args = args
        self.engine_id = engine_id
        self.rings_len = ring_area_nbytes(CONSUMERS, args.slots, args.slot_size)
        self.seg = open_segment(engine_id, GEOMETRY, FP, owner=True, rings_len=self.rings_len)
        try:
            self.rs = RingSet.for_segment(self.seg, create=True, num_workers=CONSUMERS,
                                          slots=args.slots, slot_size=args.slot_size)
        except BaseException:
            self.seg.close()
            raise
        rnd = random.Random(1)
        keys = [rnd.randbytes(40) for _ in range(KEY_POOL)]
        self.key_sets = [[keys[(i * 4 + j) % KEY_POOL] for j in range(4)]
                         for i in range(KEY_POOL)]
        self.rows = [11, 12, 13, 14]
        self.procs = []
        self.queues = []  # live multiprocessing queues (abandoned on abort)

    def close(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        for q in self.queues:  # their readers are dead: do not wait for the feeder threads
            q.cancel_join_thread()
            q.close()
        self.rs.close()
        self.seg.close()

    def start(self, transport, n, latency):
        """Start the consumers; returns (queues or None, connections)."""
        queues = None
        if transport == "mpq-2":
            queues = [CTX.Queue() for _ in range(CONSUMERS)]
        elif transport == "mpq-1":
            queues = [CTX.Queue()] * CONSUMERS
        self.queues = list(set(queues or ()))
        conns = []
        for i in range(CONSUMERS):
            parent, child = CTX.Pipe()
            if transport == "ring":
                kind, src = "ring", (self.engine_id, i, self.rings_len)
            else:
                kind, src = "queue", (queues[i],)
            p = CTX.Process(target=_consumer, args=(kind, src, n, latency, child), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            conns.append(parent)
        for c in conns:
            if not c.poll(60):
                raise RuntimeError(f"{transport}: a consumer did not start within 60 s")
            assert c.recv() == "ready"
        return queues, conns

    def finish(self, transport, queues, conns, next_id):
        stop = [pack_job(STOP_ID + next_id + i, "stop", 0, []) for i in range(CONSUMERS)]
        if transport == "ring":
            for w, raw in zip(self.rs.workers, stop):
                while not w.jobs.try_put(raw):
                    time.sleep(0.001)
        else:
            for q, raw in zip(queues, stop):
                q.put(raw)
        reports = []
        for c in conns:
            if not c.poll(300):
                raise RuntimeError(f"{transport}: a consumer did not report within 300 s")
            reports.append(c.recv())
        for p in self.procs:
            p.join(30)
        self.procs = [p for p in self.procs if p.is_alive()]
        if queues:
            for q in set(queues):
                q.close()
                q.join_thread()
        self.queues = []
        return reports

    def idle_cpu(self, transport):
        """% of one core each idle consumer used over 2 s."""
        queues, conns = self.start(transport, 1, False)
        pids = [p.pid for p in self.procs]
        time.sleep(0.3)
        before = [(_cpu_ns(pid), _wakeups(pid)) for pid in pids]
        t0 = time.perf_counter()
        time.sleep(2.0)
        after = [(_cpu_ns(pid), _wakeups(pid)) for pid in pids]
        wall = time.perf_counter() - t0
        self.finish(transport, queues, conns, 0)
        return ([100.0 * (a[0] - b[0]) / 1e9 / wall for a, b in zip(after, before)],
                [(a[1] - b[1]) / wall for a, b in zip(after, before)])

    def throughput(self, transport, n):
        queues, conns = self.start(transport, n, False)
        key_sets, rows, mask = self.key_sets, self.rows, KEY_POOL - 1
        full_waits = 0
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if transport == "ring":
            puts = [w.jobs.try_put for w in self.rs.workers]
            put0, put1 = puts
            for i in range(n):
                raw = pack_job(i, "store", 0, key_sets[i & mask], rows)
                if not puts[i & 1](raw) and not puts[~i & 1](raw):
                    while True:
                        full_waits += 1
                        time.sleep(0.0001)
                        if put0(raw) or put1(raw):
                            break
        else:
            qputs = [q.put for q in queues]
            for i in range(n):
                qputs[i & 1](pack_job(i, "store", 0, key_sets[i & mask], rows))
        producer_cpu = time.process_time() - cpu0
        reports = self.finish(transport, queues, conns, n)
        elapsed = max(r["last"] for r in reports) - t0
        total = np.zeros(n, dtype=np.uint16)
        for r in reports:
            total += np.frombuffer(r["seen"], dtype=np.uint8)
        exactly_once = bool((total == 1).all())
        return {
            "jobs_per_s": n / elapsed,
            "elapsed_s": elapsed,
            "exactly_once": exactly_once,
            "lost": int((total == 0).sum()),
            "doubled": int((total > 1).sum()),
            "per_consumer": [int(np.frombuffer(r["seen"], dtype=np.uint8).sum()) for r in reports],
            "producer_cpu_us_per_job": producer_cpu / n * 1e6,
            "consumer_cpu_us_per_job": sum(r["cpu"] for r in reports) / n * 1e6,
            "full_waits": full_waits,
        }

    def idle_floor(self):
        """Idle CPU of a process that only wakes once a second from time.sleep."""
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_sleeper, args=(child,), daemon=True)
        p.start()
        child.close()
        self.procs.append(p)
        if not parent.poll(60) or parent.recv() != "ready":
            raise RuntimeError("sleeper did not start")
        time.sleep(0.3)
        before = (_cpu_ns(p.pid), _wakeups(p.pid))
        t0 = time.perf_counter()
        time.sleep(2.0)
        after = (_cpu_ns(p.pid), _wakeups(p.pid))
        wall = time.perf_counter() - t0
        parent.send("stop")
        p.join(10)
        return 100.0 * (after[0] - before[0]) / 1e9 / wall, (after[1] - before[1]) / wall

    def latency_floor(self, samples):
        """Wake latency of a bare semaphore post -> wait, same gaps (the machine's floor)."""
        # A ring-style name of a worker index the RingSet does not use, so that
        # `shmtier clean` (clean_stale_ring_semaphores) removes it after a crash.
        name = semaphore_name(self.seg.name, CONSUMERS, "job", "items")
        sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        stamp = self.seg.arena[:8].cast("q")
        try:
            parent, child = CTX.Pipe()
            p = CTX.Process(target=_floor_consumer,
                            args=(self.engine_id, self.rings_len, name, samples, child),
                            daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            if not parent.poll(60) or parent.recv() != "ready":
                raise RuntimeError("floor consumer did not start")
            rnd = random.Random(2)
            time.sleep(0.2)
            for _ in range(samples):
                time.sleep(rnd.uniform(0.001, 0.003))
                stamp[0] = time.perf_counter_ns()
                sem.release()
            if not parent.poll(60):
                raise RuntimeError("floor consumer did not report")
            lat = sorted(x / 1000 for x in parent.recv())
            p.join(10)
        finally:
            stamp.release()
            sem.unlink()
            sem.close()
        return {"p50_us": lat[len(lat) // 2], "p99_us": lat[int(len(lat) * 0.99)],
                "max_us": lat[-1], "samples": len(lat)}

    def latency(self, transport, samples):
        queues, conns = self.start(transport, 1, True)
        rnd = random.Random(2)
        key = [self.key_sets[0][0]]
        puts = ([w.jobs.try_put for w in self.rs.workers] if transport == "ring"
                else [q.put for q in queues])
        time.sleep(0.2)
        send = []
        for k in range(samples):
            time.sleep(rnd.uniform(0.001, 0.003))
            t = time.perf_counter_ns()
            raw = pack_job(k, "probe", 0, key, (), {"t": t})
            if puts[k & 1](raw) is False:
                raise RuntimeError("ring full in the latency phase")
            send.append(time.perf_counter_ns() - t)
        reports = self.finish(transport, queues, conns, samples)
        lat = sorted(x / 1000 for r in reports for x in r["lat"])
        assert len(lat) == samples, (len(lat), samples)
        return {"p50_us": lat[len(lat) // 2], "p99_us": lat[int(len(lat) * 0.99)],
                "max_us": lat[-1], "samples": len(lat),
                "send_p50_us": statistics.median(send) / 1000}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=None, help="jobs per run (default 10^6)")
    ap.add_argument("--quick", action="store_true", help="10^5 jobs, fewer latency samples")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--slot-size", type=int, default=512)
    ap.add_argument("--latency-samples", type=int, default=None)
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    n = args.jobs or (100_000 if args.quick else 1_000_000)
    samples = args.latency_samples or (300 if args.quick else 1500)
    transports = [t for t in args.transports.split(",") if t]
    exit_through_finally()  # (removes the segment)

    print(f"bench/ring.py: 1 producer, {CONSUMERS} consumer processes (spawn), {n} jobs x "
          f"{args.repeats} runs per transport; ring {args.slots} slots x {args.slot_size} B; "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs")
    sample = pack_job(0, "store", 0, [bytes(40)] * 4, [11, 12, 13, 14])
    print(f"job: pack_job(store, 4 keys x 40 B, 4 rows) = {len(sample)} bytes")
    bench = Bench(args, f"bench-ring-{os.getpid()}")
    results: dict = {"jobs": n, "repeats": args.repeats, "transports": {}}
    try:
        runs = {t: [] for t in transports}
        for rep in range(args.repeats):
            for t in rotated(transports, rep):
                r = bench.throughput(t, n)
                runs[t].append(r)
                if not r["exactly_once"]:
                    print(f"  !! {t} run {rep}: lost {r['lost']}, doubled {r['doubled']}")
                print(f"  run {rep} {t:6s} {r['jobs_per_s'] / 1000:7.1f} k jobs/s "
                      f"({r['elapsed_s']:.2f} s, split {r['per_consumer']}, "
                      f"full waits {r['full_waits']})", flush=True)
        results["floor_latency"] = floor = bench.latency_floor(samples)
        results["floor_idle_cpu_pct"], floor_wakes = bench.idle_floor()
        for t in transports:
            lat = bench.latency(t, samples)
            idle, wakes = bench.idle_cpu(t)
            results["transports"][t] = {"runs": runs[t], "latency": lat, "idle_cpu_pct": idle,
                                        "idle_wakeups_per_s": wakes}

        print()
        print(f"{'transport':9s} {'k jobs/s  median [min-max]':28s} {'once':5s} "
              f"{'prod µs/job':>11s} {'cons µs/job':>11s} {'wake p50/p99/max µs':>21s} "
              f"{'idle CPU % (wake-ups/s)':>24s}")
        base = None
        for t in transports:
            tr = results["transports"][t]
            med, lo, hi = med_range([r["jobs_per_s"] / 1000 for r in tr["runs"]] or [0.0])
            once = all(r["exactly_once"] for r in tr["runs"])
            prod = statistics.median([r["producer_cpu_us_per_job"] for r in tr["runs"]] or [0.0])
            cons = statistics.median([r["consumer_cpu_us_per_job"] for r in tr["runs"]] or [0.0])
            lat = tr["latency"]
            idle = "/".join(f"{x:.2f}" for x in tr["idle_cpu_pct"])
            idle += " (" + "/".join(f"{x:.1f}" for x in tr["idle_wakeups_per_s"]) + " wake/s)"
            print(f"{t:9s} {med:8.1f} [{lo:6.1f}-{hi:6.1f}]{'':9s} {'yes' if once else 'NO':5s} "
                  f"{prod:11.2f} {cons:11.2f} {lat['p50_us']:7.1f}/{lat['p99_us']:6.1f}/"
                  f"{lat['max_us']:6.0f} {idle:>24s}")
            tr["median_jobs_per_s"] = med * 1000
            if t.startswith("mpq"):
                base = max(base or 0, med)
        print(f"{'floor':9s} {'(bare semaphore post -> wake; idle: time.sleep(1) loop)':58s} "
              f"{floor['p50_us']:7.1f}/{floor['p99_us']:6.1f}/{floor['max_us']:6.0f} "
              f"{results['floor_idle_cpu_pct']:.2f} ({floor_wakes:.1f} wake/s)")
        print("wake latency includes the producer's encode + put (p50: " + ", ".join(
            f"{t} {results['transports'][t]['latency']['send_p50_us']:.1f} µs" for t in transports)
            + ") and the consumer's take, both run cold after the idle gap")
        if "ring" in results["transports"] and base:
            ratio = results["transports"]["ring"]["median_jobs_per_s"] / 1000 / base
            results["ring_vs_best_queue"] = ratio
            print(f"\nring / best multiprocessing.Queue throughput (medians): {ratio:.2f}x "
                  f"(docs/design.md target: >= 3x)")
        ok = all(r["exactly_once"] for tr in results["transports"].values() for r in tr["runs"])
        print("exactly once on every run:", "yes" if ok else "NO")
        if args.json:
            write_json(args.json, results)
        return 0 if ok else 1
    finally:
        bench.close()


if __name__ == "__main__":
    sys.exit(main())
