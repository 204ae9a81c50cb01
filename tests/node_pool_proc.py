"""A process that uses a node pool for test_node_pool.py: run as
``python node_pool_proc.py '<json>'``; prints one JSON line when done (or
``STOPPED <point>`` when told to stop inside the pool and wait to be killed).

Roles (``role`` in the JSON; every role attaches ``pool`` with ``row_bytes``,
``size_bytes``, ``fp``, ``engine`` and ``register``):

- ``mixed``: ``ops`` random batches of stores and loads over keys ``0..keys-1`` (seeded by
  ``seed``); every OK load is compared with the key's bytes (``payload``): the report
  counts ``wrong`` bytes' loads. Prints ``RUNNING`` once attached.
- ``stop``: stores (``op`` "store") or loads (``op`` "load") ``stop_keys`` and, at the
  pool's crash hook point ``point`` (``mutations.crash_hook``), prints ``STOPPED <point>`` and
  sleeps until killed. At ``store.copy`` it first copies the first half of each row
  (killed mid-copy).
- ``churn``: for ``seconds``, stores fresh keys (from ``first``) and after each store
  loads ``stable`` keys (keeping them the most recently used), so the pool evicts churn
  keys only.
- ``hold``: attach, print ``ATTACHED``, then wait; ``detach`` when stdin closes.
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np

from shmtier.shared.jobs import Outcome
from shmtier.tiers.node import mutations
from shmtier.tiers.node.pool import NodePool


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\1"


def payload(i: int, row_bytes: int) -> np.ndarray:
    """The bytes key ``i`` stores: the same in every process."""
    return np.random.default_rng(i).integers(0, 256, row_bytes, dtype=np.uint8)


def _attach(a: dict) -> NodePool:
    return NodePool.attach(a["pool"], row_bytes=a["row_bytes"], size_bytes=a["size_bytes"],
                           fingerprint=a.get("fp", "model=m dtype=bfloat16"),
                           engine_id=a.get("engine", "e"), keep=a.get("keep", False),
                           register=a.get("register", True))


def mixed(a: dict) -> dict:
    rng = random.Random(a["seed"])
    n, rb = a["keys"], a["row_bytes"]
    report = {"stored": 0, "exists": 0, "rejected": 0, "loaded": 0, "missed": 0,
              "corrupt": 0, "wrong": 0, "errors": 0}
    with _attach(a) as pool:
        print("RUNNING", flush=True)
        dsts = [np.zeros(rb, np.uint8) for _ in range(a["batch"])]
        for _ in range(a["ops"]):
            ids = [rng.randrange(n) for _ in range(rng.randint(1, a["batch"]))]
            if rng.random() < 0.5:
                out = pool.store_many([key(i) for i in ids], [payload(i, rb) for i in ids])
                for o in out:
                    report[{Outcome.OK: "stored", Outcome.EXISTS: "exists",
                            Outcome.REJECTED: "rejected"}.get(o, "errors")] += 1
            else:
                out = pool.load_many([key(i) for i in ids], dsts[:len(ids)])
                for i, o, dst in zip(ids, out, dsts):
                    if o is Outcome.OK:
                        report["loaded"] += 1
                        report["wrong"] += int(not np.array_equal(dst, payload(i, rb)))
                    else:
                        report[{Outcome.MISS: "missed", Outcome.CORRUPT: "corrupt"}.get(
                            o, "errors")] += 1
    return report


def stop(a: dict) -> None:
    rb = a["row_bytes"]
    ids = a["stop_keys"]

    def hook(point, pool, rows):
        if point != a["point"]:
            return
        if point == "store.copy":
            for row, i in zip(rows, ids):
                off = row * pool.layout.row_stride
                pool.v.arena[off:off + rb // 2] = payload(i, rb)[:rb // 2].tobytes()
        print(f"STOPPED {point}", flush=True)
        while True:
            time.sleep(3600)

    pool = _attach(a)
    mutations.crash_hook = hook
    if a["op"] == "store":
        pool.store_many([key(i) for i in ids], [payload(i, rb) for i in ids])
    else:
        pool.load_many([key(i) for i in ids], [np.zeros(rb, np.uint8) for _ in ids])
    print("NOT STOPPED", flush=True)  # the point was never reached: the test fails on it
    time.sleep(3600)


def churn(a: dict) -> dict:
    rb = a["row_bytes"]
    stable = [key(i) for i in a["stable"]]
    dsts = [np.zeros(rb, np.uint8) for _ in stable]
    stores = 0
    with _attach(a) as pool:
        deadline, i = time.monotonic() + a["seconds"], a["first"]
        while time.monotonic() < deadline:
            pool.store_many([key(i)], [payload(i, rb)])
            out = pool.load_many(stable, dsts)
            if any(o is not Outcome.OK for o in out):
                return {"error": f"a stable key was not loaded: {out}"}
            i, stores = i + 1, stores + 1
    return {"stores": stores}


def hold(a: dict) -> None:
    pool = _attach(a)
    print("ATTACHED", flush=True)
    sys.stdin.read()
    pool.detach()
    print(json.dumps({"detached": True}), flush=True)


def main() -> None:
    a = json.loads(sys.argv[1])
    result = {"mixed": mixed, "stop": stop, "churn": churn, "hold": hold}[a["role"]](a)
    if result is not None:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
