#!/usr/bin/env python
"""Chunk codec: compression ratio and single-thread speed of shmtier's frame codec.

Run from a checkout::

    .venv/bin/python -m bench.codec                  # 3 data sets x 3 sizes, 7 repeats (~45 s)
    .venv/bin/python -m bench.codec --quick          # smoke test: 3 repeats, fewer chunks
    .venv/bin/python -m bench.codec --breakdown      # also time each step of the auto path
    .venv/bin/python -m bench.codec --json bench/results/codec.json
    .venv/bin/python -m bench.codec --crc            # CRC-32C only: one stream vs three (~20 s)

What is measured, per data set and chunk size, single thread (= per core):

* ``auto``, ``zstd`` and ``none``: ``ChunkEncoder.encode`` / ``ChunkDecoder.decode_into``
  in that mode -- the whole frame path a tier worker runs: byte split, zstd,
  the CRC-32s and zstd content checksum, header; decode verifies and writes into a preallocated,
  page-aligned, pre-touched destination (an arena row stand-in). Ratio is raw bytes
  over frame bytes (header included).
* ``auto+mac``, ``none+mac``: the same with a MAC key (the fs tier's ``mac_key_file``):
  a keyed BLAKE2b-256 tag over header and payload, written and verified. The "MAC cost"
  lines at the end give the extra CPU seconds per GiB of chunk bytes, per repeat
  (methods with and without the MAC timed in the same repeat), median [min-max].
* ``zstd-l1 whole`` (reference): plain ``zstandard`` level 1 on the whole chunk, no
  frame, no checksum, decompressing to a new bytes object.
* ``crc32c`` (reference): the codec's CRC-32C (``shmtier.shared._planes``) over the
  chunk alone; ``zlib crc32`` (reference): zlib's CRC-32, which format version 1 used;
  ``blake2b`` (reference): keyed ``hashlib.blake2b`` (32-byte digest) over the chunk alone,
  the MAC's work; ``hmac-sha256`` (reference): ``hmac.digest`` with SHA-256 (OpenSSL; fast
  where the CPU has the SHA extensions), the standard library's other keyed MAC.

``--crc`` runs only the CRC-32C comparison: ``crc32c_serial`` (one crc32 chain, the
implementation before the three streams) against ``crc32c`` (three interleaved chains) at
4 KiB, 64 KiB, 256 KiB and 1.4 MiB, ``hot`` (one buffer, over and over: in L1/L2) and
``cold`` (each of ~96 MiB of distinct buffers once: from memory, like an arena row), GB/s per
CPU second of the whole loop of Python calls (the call's overhead counts, as for any caller).

Data (real, generated with numpy, distinct values in every chunk): ``bf16 normal`` (float32
standard normal, top 16 bits), ``bf16 ln-scale`` (the same with a log-normal scale per
channel of 128, like K/V heads with uneven channel magnitudes), ``fp16 normal``.

Method: per repeat, every method encodes then decodes each of the data set's
distinct chunks (about 24 MiB per size, at least 8 chunks, so a chunk is not in cache
when its turn comes, as an arena row would not be) once; each call is timed with
``thread_time`` (CPU seconds of this thread: the per-core figure) and ``perf_counter``
(wall). A repeat's figure is total bytes / total time. Methods run interleaved, their
order rotated each repeat, ``gc`` off while timing. The table shows the median over
repeats and [min-max] per CPU second, and the wall-clock median. This machine has 2
shared cores that other work keeps busy: wall figures include time descheduled and
read lower; CPU figures still feel cache and memory contention. Read medians, mind
spreads.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import hmac
import os
import platform
import statistics
import sys
import time
import zlib

import numpy as np
import zstandard

from shmtier.bench.common import fmt_mr, med_range, rotated, write_json
from shmtier.shared._planes import (
    CRC32C_BLOCKS,
    CRC32C_IMPL,
    crc32c,
    crc32c_serial,
    merge,
    split,
)
from shmtier.shared import codec as C
from shmtier.shared.codec import (
    ChunkDecoder,
    ChunkEncoder,
    CompressionConfig,
)

KIB, MIB = 1 << 10, 1 << 20
SIZES = (256 * KIB, MIB, 2 * MIB)
KEY = bytes(range(32)) + b"\x00\x00\x00\x01"
MAC_KEY = bytes(range(64, 96))  # 32 bytes
GIB = 1 << 30
TARGET_RATIO, TARGET_GBPS = 1.4, 1.0
CHANNELS = 128


def bf16_normal(nbytes: int, rng: np.random.Generator) -> np.ndarray:
    f = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype("<u2").view(np.uint8)


def bf16_lognormal_scales(nbytes: int, rng: np.random.Generator) -> np.ndarray:
    scales = np.exp(rng.standard_normal(CHANNELS)).astype(np.float32)
    f = rng.standard_normal((nbytes // 2 // CHANNELS, CHANNELS), dtype=np.float32) * scales
    return (f.ravel().view(np.uint32) >> 16).astype("<u2").view(np.uint8)


def fp16_normal(nbytes: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(nbytes // 2).astype("<f2").view(np.uint8)


DATASETS = {
    "bf16 normal": bf16_normal,
    "bf16 ln-scale": bf16_lognormal_scales,
    "fp16 normal": fp16_normal,
}


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-touched uint8 buffer (like an arena row after MADV_POPULATE)."""
    buf = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-buf.ctypes.data) % 4096
    out = buf[off:off + nbytes]
    out.fill(0)
    return out


class FrameMethod:
    """shmtier's encoder/decoder in one mode."""

    def __init__(self, mode: str, mac: bool = False) -> None:
        self.name = mode + ("+mac" if mac else "")
        mac_key = MAC_KEY if mac else None
        self.enc = ChunkEncoder(CompressionConfig(mode=mode), mac_key=mac_key)
        self.dec = ChunkDecoder(mac_key=mac_key)

    def compress(self, chunk):
        parts, stats = self.enc.encode(chunk, KEY, 2)
        return parts, stats.stored_bytes

    def materialise(self, parts):  # outside the timed region: what a tier would have stored
        return memoryview(b"".join(bytes(p) for p in parts))

    def decompress(self, frame, out):
        self.dec.decode_into(frame, KEY, out)

    def codec_of(self, frame) -> str:
        return C.parse_frame_header(frame).codec


class PlainZstd:
    """Reference: zstd level 1 on the whole chunk, no framing, no checksum."""

    name = "zstd-l1 whole"

    def __init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(level=1)
        self.dctx = zstandard.ZstdDecompressor()

    def compress(self, chunk):
        comp = self.cctx.compress(chunk)
        return comp, len(comp)

    def materialise(self, comp):
        return comp

    def decompress(self, frame, out):
        self.dctx.decompress(frame)

    def codec_of(self, frame) -> str:
        return "zstd"


class Crc32Only:
    """Reference: the checksum alone (same figure in both columns)."""

    name = "crc32c"

    def __init__(self, fn=crc32c, name: str = "crc32c") -> None:
        self.fn, self.name = fn, name

    def compress(self, chunk):
        self.fn(chunk)
        return None, None

    def materialise(self, _):
        return None

    def decompress(self, frame, out):
        self.fn(out)

    def codec_of(self, frame) -> str:
        return "-"


def blake2b_keyed(buf) -> bytes:
    return hashlib.blake2b(buf, key=MAC_KEY, digest_size=32).digest()


def hmac_sha256(buf) -> bytes:
    return hmac.digest(MAC_KEY, buf, "sha256")


def mac_costs(figs: dict) -> list[tuple[str, str, list[float]]]:
    """Extra CPU seconds per GiB of chunk bytes that the MAC adds, per repeat: for each
    mode with a ``+mac`` twin and each direction, ``GiB / gbps_mac - GiB / gbps``."""
    out = []
    for name in figs:
        if not name.endswith("+mac"):
            continue
        plain = name[:-4]
        for direction in ("compress", "decompress"):
            with_mac = figs[name][direction + "_cpu"]
            without = figs[plain][direction + "_cpu"]
            out.append((plain, direction, [GIB / 1e9 / m - GIB / 1e9 / p
                                           for m, p in zip(with_mac, without)]))
    return out


def run_one(method, chunks, frames, outs) -> dict:
    """One repeat: compress every chunk, then decompress every frame.

    Returns GB/s both ways, per CPU second of this thread (``thread_time``: time the
    thread was descheduled by other work on the 2 shared cores does not count) and
    per wall second (``perf_counter``)."""
    nbytes = sum(c.nbytes for c in chunks)
    cpu_c = wall_c = cpu_d = wall_d = 0.0
    for chunk in chunks:
        c0, w0 = time.thread_time(), time.perf_counter()
        method.compress(chunk)
        w1, c1 = time.perf_counter(), time.thread_time()
        cpu_c += c1 - c0
        wall_c += w1 - w0
    for frame, out in zip(frames, outs):
        c0, w0 = time.thread_time(), time.perf_counter()
        method.decompress(frame, out)
        w1, c1 = time.perf_counter(), time.thread_time()
        cpu_d += c1 - c0
        wall_d += w1 - w0
    g = nbytes / 1e9
    return {"compress_cpu": g / cpu_c, "compress_wall": g / wall_c,
            "decompress_cpu": g / cpu_d, "decompress_wall": g / wall_d}


def breakdown(chunks, outs, repeats: int) -> list[tuple[str, float, float, float]]:
    """Time each step of the auto path separately: GB/s of raw chunk bytes per CPU
    second, median [min-max] over repeats, every chunk once per repeat."""
    n = chunks[0].nbytes
    cctx = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        write_content_size=True, write_checksum=True, **C._AUTO_PARAMS))
    dctx = zstandard.ZstdDecompressor()
    hi, lo = aligned_empty(n // 2), aligned_empty(n // 2)
    his, los = [], []
    for c in chunks:
        h, l_ = aligned_empty(n // 2), aligned_empty(n // 2)
        split(memoryview(c), h, l_)
        his.append(h)
        los.append(l_)
    comps = [cctx.compress(h) for h in his]

    def readinto(i):
        with dctx.stream_reader(comps[i], read_across_frames=False) as r:
            r.readinto(hi)

    steps = {
        "split + crc32c of low plane (as encode)":
            lambda i: split(memoryview(chunks[i]), hi, lo),
        "  crc32c alone, chunk not in cache": lambda i: crc32c(chunks[i]),
        "  zlib crc32 alone, chunk not in cache": lambda i: zlib.crc32(chunks[i]),
        "zstd high plane, compress": lambda i: cctx.compress(his[i]),
        "crc32c of compressed plane": lambda i: crc32c(comps[i]),
        "  crc32c of low plane": lambda i: crc32c(los[i]),
        "zstd high plane, decompress": readinto,
        "merge (as decode)":
            lambda i: merge(his[i], los[i], memoryview(outs[i])),
    }
    rows = []
    for name, fn in steps.items():
        figs = []
        for _ in range(repeats):
            t = 0.0
            for i in range(len(chunks)):
                t0 = time.thread_time()
                fn(i)
                t += time.thread_time() - t0
            figs.append(n * len(chunks) / t / 1e9)
        rows.append((name, statistics.median(figs), min(figs), max(figs)))
    return rows


CRC_SIZES = (4 * KIB, 64 * KIB, 256 * KIB, 1408 * KIB)
CRC_HOT_BYTES = 64 * MIB  # per (size, function, repeat), hot
CRC_COLD_BYTES = 96 * MIB  # distinct buffers per size, cold: three times this host's L3


def crc_section(repeats: int, hot_bytes: int = CRC_HOT_BYTES,
                cold_bytes: int = CRC_COLD_BYTES) -> list[dict]:
    """One stream against three: GB/s per CPU second (``thread_time`` around the whole
    loop of calls), median [min-max] over ``repeats``, the two functions interleaved with
    the order rotated per repeat, gc off. Prints a table; returns its rows."""
    fns = [("1 stream", crc32c_serial), ("3 streams", crc32c)]
    rng = np.random.default_rng(32)
    rows = []
    print(f"CRC-32C ({CRC32C_IMPL}; three-stream blocks {CRC32C_BLOCKS[0]} then "
          f"{CRC32C_BLOCKS[1]} bytes, from {3 * CRC32C_BLOCKS[1]} bytes): GB/s per CPU "
          f"second, median [min-max] of {repeats} repeats; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    hdr = (f"{'size':>9s} {'where':5s} {'1 stream':>20s} {'3 streams':>20s} "
           f"{'speed-up':>18s}")
    print(hdr)
    print("-" * len(hdr))
    gc_was = gc.isenabled()
    for size in CRC_SIZES:
        hot = [aligned_empty(size)]
        hot[0][:] = rng.integers(0, 256, size, dtype=np.uint8)
        cold = []
        for _ in range(max(8, cold_bytes // size)):
            b = aligned_empty(size)
            b[:] = rng.integers(0, 256, size, dtype=np.uint8)
            cold.append(b)
        for where, bufs in (("hot", hot * max(1, hot_bytes // size)), ("cold", cold)):
            for b in bufs[:8]:
                assert crc32c(b) == crc32c_serial(b)
            figs = {name: [] for name, _ in fns}
            gc.disable()
            try:
                for r in range(repeats):
                    for name, fn in rotated(fns, r):
                        t0 = time.thread_time()
                        for b in bufs:
                            fn(b)
                        figs[name].append(size * len(bufs) / (time.thread_time() - t0) / 1e9)
            finally:
                if gc_was:
                    gc.enable()
            ratio = [t / s_ for s_, t in zip(figs["1 stream"], figs["3 streams"])]
            label = f"{size // KIB} KiB"
            print(f"{label:>9s} {where:5s} {fmt_mr(med_range(figs['1 stream'])):>20s} "
                  f"{fmt_mr(med_range(figs['3 streams'])):>20s} "
                  f"{fmt_mr(med_range(ratio)):>17s}x", flush=True)
            rows.append({"bytes": size, "where": where, "calls": len(bufs),
                         **{name.replace(" ", "_") + "_gbps": dict(zip(
                             ("median", "min", "max"), med_range(v)), all=v)
                            for name, v in figs.items()},
                         "speedup": dict(zip(("median", "min", "max"), med_range(ratio)),
                                         all=ratio)})
        del hot, cold
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return rows


def _fmt(figs: list[float]) -> str:
    return f"{statistics.median(figs):5.2f} [{min(figs):5.2f}-{max(figs):5.2f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7,
                    help="repeats per method (>= 5 for the report)")
    ap.add_argument("--mib-per-size", type=int, default=24, help="data per (data set, size), MiB")
    ap.add_argument("--quick", action="store_true", help="3 repeats, 8 MiB per size")
    ap.add_argument("--breakdown", action="store_true", help="also time each step of the auto path")
    ap.add_argument("--crc", action="store_true",
                    help="only CRC-32C, one stream against three (see the docstring)")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.mib_per_size = 3, 8
    if args.crc:
        if args.quick:
            rows = crc_section(args.repeats, 8 * MIB, 16 * MIB)
        else:
            rows = crc_section(args.repeats)
        if args.json:
            write_json(args.json, {"repeats": args.repeats, "crc": rows})
            print(f"wrote {args.json}")
        return 0

    print(__doc__.split("Method:")[0].strip().splitlines()[0])
    print(f"host: {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; python {platform.python_version()}, numpy {np.__version__}, "
          f"zstandard {zstandard.__version__} "
          f"(libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))}), "
          f"zlib {zlib.ZLIB_RUNTIME_VERSION}, CRC-32C {CRC32C_IMPL}")
    print(f"method: single thread; per repeat each method encodes then decodes every chunk once "
          f"({args.mib_per_size} MiB per data set and size, >= 8 distinct chunks), "
          f"methods interleaved with rotated order; median of {args.repeats} repeats "
          f"[min-max]; GB/s = raw bytes / thread CPU time (per core), 'wall' = median "
          f"by wall clock; ratio = raw / stored bytes (frame header "
          f"included). auto = split_zstd fast strategy, min_match 7, hash_log 6; zstd = "
          f"split_zstd at level 1; none = raw frame (CRC + copy); +mac: with a keyed "
          f"BLAKE2b tag.")
    print()

    results = []
    hdr = (f"{'data':14s} {'chunk':>7s} {'method':14s} {'codec':10s} {'ratio':>6s}  "
           f"{'compress GB/s cpu':>19s} {'wall':>5s}  {'decompress GB/s cpu':>19s} {'wall':>5s}")
    print(hdr)
    print("-" * len(hdr))
    gc_was = gc.isenabled()
    for ds_name, gen in DATASETS.items():
        for size in SIZES:
            count = max(8, args.mib_per_size * MIB // size)
            rng = np.random.default_rng(zlib.crc32(f"{ds_name}|{size}".encode()))
            chunks = []
            for _ in range(count):
                c = aligned_empty(size)
                c[:] = gen(size, rng)
                chunks.append(c)
            outs = [aligned_empty(size) for _ in range(count)]
            methods = [FrameMethod("auto"), FrameMethod("zstd"), FrameMethod("none"),
                       FrameMethod("auto", mac=True), FrameMethod("none", mac=True),
                       PlainZstd(), Crc32Only(), Crc32Only(zlib.crc32, "zlib crc32"),
                       Crc32Only(blake2b_keyed, "blake2b"),
                       Crc32Only(hmac_sha256, "hmac-sha256")]
            prepared = {}
            for m in methods:
                frames, stored, codecs = [], 0, set()
                for c, o in zip(chunks, outs):
                    parts, nstored = m.compress(c)
                    frame = m.materialise(parts)
                    frames.append(frame)
                    if frame is not None:
                        stored += nstored
                        codecs.add(m.codec_of(frame))
                        m.decompress(frame, o)
                        if isinstance(m, FrameMethod):
                            assert np.array_equal(o, c), f"{m.name}: round trip differs"
                prepared[m.name] = (frames, stored, ",".join(sorted(codecs)))
            figs = {m.name: {} for m in methods}
            gc.disable()
            try:
                for r in range(args.repeats):
                    for m in rotated(methods, r):
                        one = run_one(m, chunks, prepared[m.name][0], outs)
                        for k, v in one.items():
                            figs[m.name].setdefault(k, []).append(v)
            finally:
                if gc_was:
                    gc.enable()
            nbytes = size * count
            for m in methods:
                frames, stored, codecs = prepared[m.name]
                f = figs[m.name]
                ratio = nbytes / stored if stored else None
                row = {"data": ds_name, "chunk_bytes": size, "chunks": count, "method": m.name,
                       "codec": codecs, "ratio": ratio}
                for k, v in f.items():
                    row[k + "_gbps"] = {"median": statistics.median(v), "min": min(v),
                                        "max": max(v), "all": v}
                results.append(row)
                rs = f"{ratio:6.3f}" if ratio else f"{'-':>6s}"
                label = f"{size // KIB} KiB" if size < MIB else f"{size // MIB} MiB"
                print(f"{ds_name:14s} {label:>7s} {m.name:14s} {codecs:10s} {rs}  "
                      f"{_fmt(f['compress_cpu'])} {statistics.median(f['compress_wall']):5.2f}  "
                      f"{_fmt(f['decompress_cpu'])} {statistics.median(f['decompress_wall']):5.2f}",
                      flush=True)
            label = f"{size // KIB} KiB" if size < MIB else f"{size // MIB} MiB"
            for mode, direction, extra in mac_costs(figs):
                print(f"  MAC cost, {mode} {direction:10s}: {_fmt(extra)} CPU s per GiB")
                results.append({"data": ds_name, "chunk_bytes": size, "method": mode + "+mac",
                                "mac_cost_" + direction + "_cpu_s_per_gib": {
                                    "median": statistics.median(extra), "min": min(extra),
                                    "max": max(extra), "all": extra}})
            print()
            if args.breakdown and ds_name == "bf16 normal":
                print(f"  breakdown of auto, bf16 normal, {size // KIB} KiB chunks "
                      f"(GB/s of raw chunk bytes per CPU second, median [min-max]):")
                for name, med, lo_, hi_ in breakdown(chunks, outs, args.repeats):
                    print(f"    {name:30s} {med:6.2f} [{lo_:5.2f}-{hi_:5.2f}]")
                print()

    print(f"target (issue): ratio >= {TARGET_RATIO} on random-normal bf16 at >= {TARGET_GBPS} "
          f"GB/s compress per core (GB/s per CPU second, median), mode auto:")
    all_met = True
    for row in results:
        if row["data"] == "bf16 normal" and row["method"] == "auto" and "ratio" in row:
            cpu = row["compress_cpu_gbps"]
            ok_r = row["ratio"] >= TARGET_RATIO
            ok_s = cpu["median"] >= TARGET_GBPS
            all_met &= ok_r and ok_s
            print(f"  {row['chunk_bytes'] // KIB:5d} KiB: ratio {row['ratio']:.3f} "
                  f"({'met' if ok_r else 'NOT met'}); compress {cpu['median']:.2f} GB/s "
                  f"[{cpu['min']:.2f}-{cpu['max']:.2f}] ({'met' if ok_s else 'NOT met'}); "
                  f"wall-clock median {row['compress_wall_gbps']['median']:.2f}")
    print(f"  => {'met' if all_met else 'NOT met'} at every chunk size")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    if args.json:
        write_json(args.json, {"repeats": args.repeats, "results": results})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
