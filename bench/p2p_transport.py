"""Loopback GB/s of the p2p transport: raw ZeroMQ against ChunkClient.fetch into rows.

    .venv/bin/python -m bench.p2p_transport                 # 64 chunks of 1.4 MiB, 7 repeats
    .venv/bin/python -m bench.p2p_transport --quick         # smoke test: 16 chunks, 2 repeats
    .venv/bin/python -m bench.p2p_transport --json bench/results/p2p_transport.json

Method: each configuration has its own peer process (multiprocessing spawn) on
tcp://127.0.0.1, started once; every repeat runs each configuration once, in an order
rotated per repeat, and moves ``--chunks`` chunks of ``--chunk-mib`` MiB.

- ``raw`` / ``raw+curve``: a sender process's DEALER sends the chunks as single frames
  (``send(row, copy=False)`` from a numpy arena) to the peer's ROUTER, which receives
  each with ``copy=False`` (no copy out of libzmq's buffer) and answers once the last
  one is in; timed from the first send to that answer. ``+curve``: the same with
  CurveZMQ encryption (no ZAP handler).
- ``fetch`` / ``fetch+curve``: the peer runs a ``ChunkServer`` over an arena of rows
  (the curve one with keys and an allow-list); this process's ``ChunkClient.fetch``
  takes ``--batch`` keys per call into its own rows: zero-copy send of the row, CRC-32C
  at the server, the copy into the destination row and its CRC-32C check at the client
  (one pass: ``copy_crc32c``). ``client µs/chunk``: the CPU time of the thread that calls
  ``fetch`` (not libzmq's I/O thread) per chunk: header, receive, copy and check; little
  moved by other load on the host, unlike the wall figures. ``--pin``: the peers on the
  last CPU, this process (the client, the raw receiver) on the others.
  Every fetched row is compared with the peer's bytes after the timed region.

GB/s = chunk bytes / wall seconds (1e9 bytes); the table shows median [min-max] over the
repeats. The CRC-32C line is one core's checksum speed on a chunk (context for the
fetch/raw gap). On a shared 2-core machine both processes and libzmq's I/O threads compete
for the cores: read the medians and mind the spreads.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import numpy as np

from shmtier.bench.common import exit_through_finally, fmt_mr, join_or_kill, med_range, rotated, write_json

FP, SEED = "bench-layout", 1


def _arena(chunks: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (chunks, size), dtype=np.uint8)


def process_cpu_s(pid: int) -> float:
    """Seconds every thread of process ``pid`` has run on a CPU so far (libzmq's I/O
    threads included; /proc/<pid>/task/*/schedstat, ns resolution; threads that ended
    are not counted)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return total / 1e9


def _place(niceness: int, cpus: set | None) -> None:
    """Niceness and CPUs of this process, set before the zmq context: libzmq's I/O
    thread inherits both."""
    os.nice(niceness)
    if cpus:
        os.sched_setaffinity(0, cpus)


def raw_peer(conn, curve: tuple | None, niceness: int = 0, cpus: set | None = None) -> None:
    """The raw configurations' receiving side: a ROUTER that counts frames."""
    _place(niceness, cpus)
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    if curve:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = curve
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    got = 0
    try:
        while not conn.poll():
            if not sock.poll(50):
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if len(frames[1]) == 3 and frames[1].bytes == b"end":
                    sock.send_multipart([frames[0], str(got).encode()])
                    got = 0
                else:
                    got += len(frames[1])
    finally:
        sock.close(0)
        ctx.term()


def raw_sender(conn, port: int, curve: tuple | None, rows: list, niceness: int = 0,
               cpus: set | None = None) -> None:
    """The raw configurations' sending side: on each "run" from ``conn``, a DEALER sends
    ``rows`` as single frames (``copy=False``) and the byte count ends with b"end"; answers
    (seconds from the first send to the peer's answer, bytes the peer counted)."""
    _place(niceness, cpus)
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if curve:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(f"tcp://127.0.0.1:{port}")
    conn.send("ready")
    try:
        while conn.recv() == "run":
            t0 = time.perf_counter()
            for row in rows:
                sock.send(row, copy=False)
            sock.send(b"end")
            got = int(sock.recv())
            conn.send((time.perf_counter() - t0, got))
    finally:
        sock.close(0)
        ctx.term()


class RawLoopback:
    """The ``raw`` / ``raw+curve`` measurement (one source of truth: bench/p2p_tier.py
    uses it too): a ``raw_peer`` process (ROUTER) and a ``raw_sender`` process (DEALER)
    connected to it, both at ``niceness`` (added to this process's; 0 = the same).
    ``run()`` has the sender send each of ``rows`` as one frame (``copy=False``) and
    returns the seconds, measured in the sender, from the first send to the peer's answer
    that it has them all. ``curve``: (server key pair, client key pair), CurveZMQ without
    ZAP. ``peer_cpus`` / ``sender_cpus``: the CPUs each side runs on (None: any). Close
    with ``close()``."""

    def __init__(self, ctx, rows: list, curve: tuple | None = None, niceness: int = 0,
                 peer_cpus: set | None = None, sender_cpus: set | None = None):
        skeys, ckeys = curve if curve else (None, None)
        self.total = sum(len(r) for r in rows)
        self.procs, self.conns = [], []
        try:
            port = self._start(ctx, raw_peer, (skeys.public, skeys.secret) if curve else None,
                               niceness, peer_cpus)
            self._start(ctx, raw_sender, port, (skeys.public, ckeys.public, ckeys.secret)
                        if curve else None, rows, niceness, sender_cpus)
        except BaseException:
            self.close()
            raise

    def _start(self, ctx, target, *args):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        proc.start()
        child.close()
        self.procs.append(proc)
        self.conns.append(parent)
        if not parent.poll(60):
            raise RuntimeError(f"{target.__name__} process did not start")
        return parent.recv()

    def cpu_s(self) -> float:
        """CPU seconds both processes (peer and sender) have used so far."""
        return sum(process_cpu_s(p.pid) for p in self.procs)

    def receiver_cpu_s(self) -> float:
        """CPU seconds the receiving process (the peer) has used so far."""
        return process_cpu_s(self.procs[0].pid)

    def run(self) -> float:
        self.conns[1].send("run")
        if not self.conns[1].poll(300):
            raise RuntimeError("raw_sender did not answer")
        dt, got = self.conns[1].recv()
        assert got == self.total, (got, self.total)
        return dt

    def close(self) -> None:
        for conn in reversed(self.conns):
            try:
                conn.send("stop")
            except OSError:
                pass
        join_or_kill(self.procs, 5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def server_peer(conn, chunks: int, size: int, keydir: str | None,
                given_crc: bool = False, cpus: set | None = None) -> None:
    """The fetch configurations' serving side: a ChunkServer over an arena. ``given_crc``:
    the provider hands each row with its CRC-32C, computed once at start (as the p2p
    endpoint computes it when a row is parked), so the server does not checksum per send.
    ``cpus``: the CPUs it runs on (None: any)."""
    _place(0, cpus)
    from shmtier.shared.codec import crc32c
    from shmtier.tiers.p2p.keys import AllowList, load_keypair
    from shmtier.tiers.p2p.endpoint.transport import ChunkServer
    arena = _arena(chunks, size, 7)
    rows = {b"chunk-%d" % i: memoryview(arena[i]) for i in range(chunks)}
    if given_crc:
        rows = {k: (v, crc32c(v)) for k, v in rows.items()}
    if keydir:
        server = ChunkServer("127.0.0.1", 0, provider=rows.get, fingerprint=FP, hash_seed=SEED,
                             keys=load_keypair(os.path.join(keydir, "server.key_secret")),
                             allow=AllowList.from_directory(os.path.join(keydir, "allowed")))
    else:
        server = ChunkServer("127.0.0.1", 0, provider=rows.get, fingerprint=FP,
                             hash_seed=SEED, plaintext=True)
    conn.send(server.port)
    try:
        while not conn.poll():
            server.poll(0.05)
    finally:
        server.close()


def copy_into_rows(chunk: np.ndarray, rows: np.ndarray) -> dict:
    """µs per chunk (median of each of 5 rounds over ``rows``, one chunk into each row in
    turn: rows beyond the caches, as arena rows are) of the client's ways to land a
    received chunk: ``memcpy+crc32c`` (the copy, then the check over the row: before the
    p2pfast round), ``copy_crc32c/streams`` (one pass, three crc32 streams) and
    ``copy_crc32c`` (one pass, the import-time choice: folding with VPCLMULQDQ where the
    CPU has it)."""
    from shmtier.shared import _planes

    def memcpy_crc(row, src):
        row[:] = src
        return _planes.crc32c(row)

    ways = {"memcpy+crc32c": memcpy_crc,
            "copy_crc32c/streams": getattr(_planes, "copy_crc32c_streams", None),
            "copy_crc32c": getattr(_planes, "copy_crc32c", None)}
    out: dict = {k: [] for k, fn in ways.items() if fn is not None}
    src = memoryview(np.ascontiguousarray(chunk))
    views = [memoryview(r) for r in rows]
    for _ in range(5):
        for name in out:
            fn, times = ways[name], []
            for row in views:
                t0 = time.perf_counter()
                fn(row, src)
                times.append(time.perf_counter() - t0)
            out[name].append(sorted(times)[len(times) // 2] * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=64, help="chunks moved per repeat")
    ap.add_argument("--chunk-mib", type=float, default=1.4)
    ap.add_argument("--batch", type=int, default=32, help="keys per fetch call")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="16 chunks, 2 repeats")
    ap.add_argument("--pin", action="store_true",
                    help="the peers (servers, raw senders) on the last CPU, this process on the others")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.chunks, args.repeats = 16, 2
    exit_through_finally()

    import logging
    logging.basicConfig(level=logging.ERROR)  # the plaintext WARNINGs are expected here
    import zmq
    from shmtier.shared.codec import crc32c
    from shmtier.tiers.p2p.keys import generate_keypair_files, load_keypair
    from shmtier.tiers.p2p.endpoint.transport import ChunkClient

    size = int(args.chunk_mib * 2 ** 20)
    total = size * args.chunks
    pin_peer = pin_here = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs 2 CPUs or more")
        pin_peer, pin_here = {cpus[-1]}, set(cpus[:-1])
        os.sched_setaffinity(0, pin_here)  # (before this process's zmq context: its I/O thread too)
    try:  # the client's process mallocs as the p2p endpoint's does (an older shmtier: as is)
        from shmtier.tiers.p2p.endpoint.process import keep_receive_buffers
        keep_receive_buffers()
    except ImportError:
        pass
    ctx = mp.get_context("spawn")
    keydir = tempfile.mkdtemp(prefix="shmtier-p2p-bench-")
    procs, conns, clients = [], [], []
    try:
        generate_keypair_files(keydir, "server")
        generate_keypair_files(os.path.join(keydir, "allowed"), "client")
        skeys = load_keypair(os.path.join(keydir, "server.key_secret"))
        ckeys = load_keypair(os.path.join(keydir, "allowed", "client.key_secret"))

        def start(target, *a) -> int:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(child, *a), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
            if not parent.poll(60):
                raise RuntimeError(f"peer process {target.__name__} did not start")
            return parent.recv()

        src = _arena(args.chunks, size, 7)  # the bytes the peers hold (same seed)

        def raw_runner(curve: bool):
            raw = RawLoopback(ctx, list(src), (skeys, ckeys) if curve else None,
                              peer_cpus=pin_here, sender_cpus=pin_peer)
            clients.append(raw)
            raw.run()  # warm-up: connection and handshake
            return raw.run

        dst = np.zeros((args.chunks, size), np.uint8)
        client_us: dict = {}  # run function -> the fetching thread's CPU µs per chunk, per repeat
        keys = [b"chunk-%d" % i for i in range(args.chunks)]

        def fetch_runner(curve: bool, given_crc: bool = False):
            port = start(server_peer, args.chunks, size, keydir if curve else None, given_crc,
                         pin_peer)
            c = (ChunkClient("127.0.0.1", port, fingerprint=FP, hash_seed=SEED, keys=ckeys,
                             server_key=skeys.public) if curve else
                 ChunkClient("127.0.0.1", port, fingerprint=FP, hash_seed=SEED, plaintext=True))
            clients.append(c)

            def run() -> float:
                dst[:] = 0
                t0, c0 = time.perf_counter(), time.thread_time()
                for b in range(0, args.chunks, args.batch):
                    r = c.fetch(keys[b:b + args.batch], list(dst[b:b + args.batch]), 60.0)
                    assert r.all_ok, r.details
                dt = time.perf_counter() - t0
                client_us.setdefault(run, []).append((time.thread_time() - c0) * 1e6 / args.chunks)
                assert np.array_equal(dst, src), "fetched bytes differ"
                return dt
            run()
            client_us.pop(run)  # (the warm-up)
            return run

        runners = {"raw": raw_runner(False), "raw+curve": raw_runner(True),
                   "fetch": fetch_runner(False), "fetch+curve": fetch_runner(True),
                   "fetch/crc": fetch_runner(False, True),
                   "fetch/crc+curve": fetch_runner(True, True)}
        movers = {"raw": clients[0].procs, "raw+curve": clients[1].procs}  # whose CPU counts
        for i, name in enumerate(list(runners)[2:]):
            movers[name] = [procs[i], mp.current_process()]
        gbps: dict[str, list[float]] = {name: [] for name in runners}
        cpu_s = {name: 0.0 for name in runners}

        def cpu(name: str) -> float:
            return sum(process_cpu_s(p.pid) for p in movers[name])

        for rep in range(args.repeats):
            for name in rotated(list(runners), rep):
                cpu0 = cpu(name)
                gbps[name].append(total / runners[name]() / 1e9)
                cpu_s[name] += cpu(name) - cpu0
        crc_t = []
        for _ in range(20):
            t0 = time.perf_counter()
            crc32c(src[0])
            crc_t.append(time.perf_counter() - t0)
        crc_gbps = size / min(crc_t) / 1e9
        copy_us = copy_into_rows(src[0], dst)

        print(f"p2p transport loopback, tcp://127.0.0.1, {args.chunks} chunks of "
              f"{size} B ({args.chunk_mib} MiB) per repeat, {args.repeats} repeats, "
              f"fetch batch {args.batch}, {os.cpu_count()} CPUs, pyzmq {zmq.__version__} / "
              f"libzmq {zmq.zmq_version()}")
        print("fetch/crc: the server is handed each row's CRC-32C (computed once, before); "
              "cpu s/GB: CPU of the processes that move the bytes (raw: sender and receiver; "
              "fetch: server and client), every thread, per GB, all repeats")
        print(f"{'method':<16} {'GB/s median [min-max]':>26} {'vs raw (same security)':>24} "
              f"{'cpu s/GB':>9} {'client µs/chunk':>20}")
        med = {k: med_range(v)[0] for k, v in gbps.items()}
        for name, values in gbps.items():
            base = "raw+curve" if name.endswith("curve") else "raw"
            ratio = "" if name.startswith("raw") else f"{med[name] / med[base]:.2f}x"
            us = client_us.get(runners[name])
            print(f"{name:<16} {fmt_mr(med_range(values)):>26} {ratio:>24} "
                  f"{cpu_s[name] / (total * args.repeats / 1e9):>9.2f} "
                  f"{fmt_mr(med_range(us), 0) if us else '':>20}")
        print(f"CRC-32C of one chunk, one core: {crc_gbps:.1f} GB/s (best of 20)")
        print("one chunk into a row not in cache, then its check (the client's work), µs "
              "median [min-max] of 5 rounds over the rows: " + ", ".join(
                  f"{k} {fmt_mr(med_range(v), 0)}" for k, v in copy_us.items()))
        if args.json:
            write_json(args.json, {"chunks": args.chunks, "chunk_bytes": size,
                                   "repeats": args.repeats, "batch": args.batch,
                                   "gbps": gbps, "cpu_s": cpu_s, "crc32c_gbps": crc_gbps,
                                   "client_us_per_chunk": {n: client_us.get(r) for n, r in
                                                           runners.items()},
                                   "copy_us": copy_us})
    finally:
        for c in clients:
            c.close()
        for conn in conns:
            try:
                conn.send("stop")
            except OSError:
                pass
        join_or_kill(procs, 5)
        shutil.rmtree(keydir, ignore_errors=True)


if __name__ == "__main__":
    main()
