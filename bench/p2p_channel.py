"""The p2p tier's control channel (``shmtier/tiers/p2p/channel.py``): encode + decode of a
frame as the channel does it (arrays, typed messages) against maps keyed ``"t"`` (the
channel before it had versions), typed or not. CPU only, no socket: the scheduler thread's
and the endpoint's share of a message. Prints µs per frame, the least of ``--repeats``.

    nice -n 10 python -m bench.p2p_channel --repeats 5

Figures: bench/README.md ("p2p_channel.py").
"""

from __future__ import annotations

import argparse
import time

import msgpack

from shmtier.tiers.p2p import channel
from shmtier.tiers.p2p.channel import Complete, Load, LoadDone, Park

KEYS = [bytes([i]) * 36 for i in range(16)]
FRAMES = {  # a step's frame from the scheduler half; one answer of the endpoint
    "step: park+complete+load, 16 keys each": (
        [Park("kv-1", KEYS, list(range(16))), Complete("kv-1"),
         Load(7, "kv-2", "10.0.0.2:5601", "Z85serverkey", KEYS, list(range(16, 32)))],
        channel.from_scheduler),
    "answer: load_done": ([LoadDone(7, list(range(16)), 16 * 1441792, 0.0125, "")],
                          channel.from_endpoint),
}
_NAMES = {cls: name for name, cls in (
    ("park", Park), ("complete", Complete), ("load", Load), ("load_done", LoadDone))}
_BY_NAME = {name: cls for cls, name in _NAMES.items()}


def as_maps(messages: list) -> list[dict]:
    return [dict(zip(m._fields, m), t=_NAMES[type(m)]) for m in messages]


def per_frame(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs per figure (the least counts)")
    ap.add_argument("--frames", type=int, default=20000, help="frames per run")
    args = ap.parse_args(argv)
    for what, (messages, decode) in FRAMES.items():
        maps = as_maps(messages)
        ways = {
            "arrays, typed (channel.py)": lambda: decode(channel.encode(messages)),
            "maps, typed": lambda: [_BY_NAME[d.pop("t")](**d) for d in msgpack.unpackb(
                msgpack.packb(as_maps(messages), use_bin_type=True), raw=False)],
            "maps, untyped (before)": lambda: msgpack.unpackb(
                msgpack.packb(maps if len(maps) > 1 else maps[0], use_bin_type=True),
                raw=False),
        }
        nbytes = {"arrays, typed (channel.py)": len(channel.encode(messages)),
                  "maps, typed": len(msgpack.packb(maps, use_bin_type=True)),
                  "maps, untyped (before)": len(msgpack.packb(
                      maps if len(maps) > 1 else maps[0], use_bin_type=True))}
        for way, fn in ways.items():
            best = min(per_frame(fn, args.frames) for _ in range(args.repeats))
            print(f"{what:40s} {way:28s} {best:6.2f} µs  {nbytes[way]:5d} B")


if __name__ == "__main__":
    main()
