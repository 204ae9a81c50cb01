"""The ``shmtier`` CLI against real segments, roots, buckets and worker pools: ``ls`` and
``clean`` after a SIGKILLed owner, ``fsck`` of an fs root an engine is using and of an
obj bucket, ``top`` reading a live engine (and not slowing its scheduler), the external
pool's metrics endpoint scraped over HTTP."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from fs_engine import END, Engine, key
from shmtier.cli import main
from shmtier.config import KVLayout
from shmtier.contract import ReqContext
from shmtier.shared import procinfo
from shmtier.shared.snapshot import snapshot
from shmtier.spec import TieringOffloadingSpec
from shmtier.storage.chunk_names import chunk_key
from shmtier.tiers.fs.fsck import fsck_root


def run_cli(*argv: str) -> tuple[int, str]:
    """``main(argv)`` in this process: (exit code, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def cli_json(*argv: str) -> tuple[int, object]:
    code, text = run_cli(*argv, "--json")
    return code, json.loads(text)


# ------------------------------------------------------------------ ls / clean

_OWNER = """
import sys, time
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.ring import RingSet, ring_area_nbytes
from shmtier.shared.segment import open_segment
seg = open_segment(sys.argv[1], ArenaGeometry(4, 4096, 4096, 1), "fp", owner=True,
                   rings_len=ring_area_nbytes(1, 4, 512))
rings = RingSet.create(seg.name, seg.rings, 1, 4, 512)
print("ready", flush=True)
time.sleep(60)
"""


def _namespace_with_temps(root):
    """A namespace under ``root`` with one temp file of a dead writer and one of a live
    one (this process); returns their paths."""
    from shmtier.tiers.fs.backend import FsBackend

    b = FsBackend(str(root), "fp-clean", min_free_bytes=None)
    try:
        rel = b.ns.rel_dir(key(1))
        b.ns.in_leaf(rel, lambda fd: None, create=True)
        leaf = os.path.join(b.namespace_dir, rel)
        live = os.path.join(leaf, b.ns.temp_name(key(1).hex()))  # this process's
        boot = procinfo.boot_id()[:4].hex()  # a pid above pid_max: a writer that is gone
        dead = os.path.join(leaf, f".{key(2).hex()[:16]}.{boot}-{2 ** 22 + 17}-1-1.tmp")
    finally:
        b.close()
    for p in (live, dead):
        with open(p, "wb") as f:
            f.write(b"partial")
    return dead, live


def test_ls_and_clean_after_a_sigkilled_owner(engine_id, tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, engine_id], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert owner.stdout.readline().strip() == "ready"
        code, rows = cli_json("ls")
        mine = [r for r in rows if r["engine_id"] == engine_id]
        assert code == 0 and len(mine) == 1 and mine[0]["alive"]
        assert mine[0]["rows"] == {"total": 4, "free": 4, "pending": 0, "ready": 0,
                                   "pinned": 0, "used": 0}
        assert mine[0]["geometry"]["num_chunks"] == 4 and mine[0]["owner_pid"] == owner.pid
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        # the alias, in words
        code, text = run_cli("segments")
        line = next(ln for ln in text.splitlines() if ln.startswith(engine_id))
        assert code == 0 and "STALE" in line and "0/4" in line, text
        code, rows = cli_json("ls")
        assert [r["alive"] for r in rows if r["engine_id"] == engine_id] == [False]
        dead, live = _namespace_with_temps(tmp_path)
        code, text = run_cli("clean", engine_id, "--root", str(tmp_path))
        assert code == 0
        assert f"removed /shmtier_{engine_id}" in text
        assert text.count(".job.") == 2 and text.count(".res.") == 2  # its ring semaphores
        assert "removed " + dead in text.replace(str(tmp_path.resolve()), str(tmp_path))
        assert not os.path.exists(dead) and os.path.exists(live)
        assert not [e for e in os.listdir("/dev/shm") if engine_id in e]
        code, rows = cli_json("ls")
        assert not [r for r in rows if r["engine_id"] == engine_id]
        assert run_cli("clean", engine_id)[1].strip() == "nothing stale"
        assert main(["clean", engine_id, "--root", str(tmp_path / "nope")]) == 2
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)


# ------------------------------------------------------------------ fsck: fs root

def _chunk_files(root) -> list[str]:
    return sorted(str(p) for p in root.rglob("*.kv"))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_fsck_finds_and_repairs_a_root_while_an_engine_uses_it(engine_id, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    # vLLM's own fs tier files beside ours (and a .bin file named like nothing of ours)
    vllm = root / "vllm-kv" / "ab" / "cd"
    vllm.mkdir(parents=True)
    (vllm / "0123abcd.bin").write_bytes(b"vllm" * 100)
    (root / "other.bin").write_bytes(b"x" * 10)
    e = Engine(engine_id, root, chunks=16, workers=1)
    try:
        ctx = ReqContext("a")
        e.offload([key(i) for i in range(12)], 0, ctx)
        e.settle()
        files = _chunk_files(root)
        assert len(files) == 12
        assert main(["fsck", str(root)]) == 0
        by_key = {chunk_key(os.path.basename(p)): p for p in files}
        payload_flip, header_flip, truncated, moved = (by_key[key(i)] for i in range(4))
        _flip(payload_flip, os.path.getsize(payload_flip) - 10)  # found by --verify only
        _flip(header_flip, 20)
        os.truncate(truncated, os.path.getsize(truncated) // 2)
        leaf = os.path.dirname(by_key[key(5)])
        other_leaf = next(os.path.dirname(p) for p in files if os.path.dirname(p) not in
                          (leaf, os.path.dirname(moved)))
        misplaced = os.path.join(other_leaf, os.path.basename(moved))
        os.rename(moved, misplaced)
        foreign = os.path.join(leaf, "notes.txt")
        with open(foreign, "w") as f:
            f.write("not a chunk")
        boot = procinfo.boot_id()[:4].hex()
        orphan = os.path.join(leaf, f".{key(6).hex()[:16]}.{boot}-{2 ** 22 + 17}-1-1.tmp")
        pid, started = procinfo.me()
        live = os.path.join(leaf, f".{key(7).hex()[:16]}.{boot}-{pid}-{started}-1.tmp")
        for p in (orphan, live):
            with open(p, "wb") as f:
                f.write(b"partial frame")
        planted = {"corrupt": 1, "truncated": 1, "misplaced": 1, "foreign": 1, "orphan_temp": 1}

        code, report = cli_json("fsck", str(root))
        assert code == 1 and report["counts"] == planted, report["problems"]
        assert report["other_entries"] == 2 and len(report["namespaces"]) == 1
        assert report["namespaces"][0]["temp_live"] == 1
        # --verify while the engine stores more (files appear mid-walk: fine)
        found = []  # the walk in a thread (stdout is the main thread's)
        walker = threading.Thread(target=lambda: found.append(
            fsck_root(str(root), verify=True).as_dict()))
        walker.start()
        e.offload([key(i) for i in range(100, 112)], 20, ctx)
        e.settle()
        walker.join(60)
        assert found[0]["exit_code"] == 1
        assert found[0]["counts"] == {**planted, "corrupt": 2}, found[0]["problems"]
        paths = {p["kind"]: p["path"] for p in found[0]["problems"]}
        assert paths["misplaced"].endswith(os.path.basename(moved))

        code, report = cli_json("fsck", str(root), "--verify", "--repair")
        assert code == 0 and report["repaired"] == 6 and all(
            p["repaired"] for p in report["problems"])
        for p in (payload_flip, header_flip, truncated, misplaced, foreign, orphan):
            assert not os.path.exists(p), p
        assert os.path.exists(live)
        assert (vllm / "0123abcd.bin").read_bytes() == b"vllm" * 100
        assert (root / "other.bin").read_bytes() == b"x" * 10
        code, report = cli_json("fsck", str(root), "--verify")
        assert code == 0 and report["problems"] == []
        assert report["chunks"] == len(_chunk_files(root)) == 24 - 4
        # the engine still serves what is left: chunks evicted from its CPU tier come back
        e.until_hit([key(4), key(5)], ctx)
    finally:
        e.close()
    assert main(["fsck", str(tmp_path / "missing")]) == 2
    assert main(["fsck"]) == 2


def test_fsck_checks_macs_with_the_key_and_never_follows_links(tmp_path):
    from shmtier.tiers.fs.backend import FsBackend

    root = tmp_path / "root"
    root.mkdir()
    key_file = tmp_path / "mac.key"
    key_file.write_text(os.urandom(32).hex())
    key_file.chmod(0o600)
    mac = bytes.fromhex(key_file.read_text())
    arena = np.random.default_rng(0).integers(0, 256, (4, 4096), dtype=np.uint8)
    b = FsBackend(str(root), "fp-mac", min_free_bytes=None, mac_key=mac)
    try:
        assert b.store([key(i) for i in range(4)], list(range(4)), arena, 4096).all_ok
        tagged = b.path_for(key(0))
    finally:
        b.close()
    target = tmp_path / "outside.kv"
    target.write_bytes(b"keep me")
    link = os.path.join(os.path.dirname(tagged), key(9).hex() + ".kv")
    os.symlink(target, link)
    # the last byte of the frame's tag (just before the payload): only the MAC catches it
    with open(tagged, "rb") as f:
        data = f.read()
    _flip(tagged, 40 + len(key(0)) + 31)
    code, report = cli_json("fsck", str(root), "--verify")
    ns = report["namespaces"][0]
    assert code == 1 and ns["mac"] and not ns["mac_checked"]
    assert report["counts"] == {"link": 1}
    code, report = cli_json("fsck", str(root), "--verify", "--mac-key-file", str(key_file))
    assert report["namespaces"][0]["mac_checked"]
    assert report["counts"] == {"link": 1, "corrupt": 1}
    assert [p["detail"] for p in report["problems"] if p["kind"] == "corrupt"][0].startswith("mac")
    code, report = cli_json("fsck", str(root), "--repair", "--verify", "--mac-key-file",
                            str(key_file))
    assert code == 0 and not os.path.lexists(link) and target.read_bytes() == b"keep me"
    assert len(data) and not os.path.exists(tagged)


def _spec_fingerprint(**layout) -> tuple[str, int]:
    """A real engine's layout fingerprint and chunk bytes (the spec's; nothing is created)."""
    spec = TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 2},
                                 KVLayout("m", "bfloat16", 16, 4096, 2, **layout), "fp-spec")
    return spec.fingerprint, spec.chunk_payload_bytes


def test_fsck_finds_and_repairs_a_frame_of_another_chunk_size(tmp_path):
    from shmtier.storage.fsck import layout_chunk_bytes
    from shmtier.tiers.fs.backend import FsBackend

    fingerprint, chunk = _spec_fingerprint()
    assert chunk == 4096 * 2 * 2 and layout_chunk_bytes(fingerprint) == chunk
    replicated, one_copy = _spec_fingerprint(replicated_layout=True)
    assert layout_chunk_bytes(replicated) == one_copy == 4096 * 2
    assert layout_chunk_bytes(fingerprint + "|mac=0123abcd") == chunk
    root = tmp_path / "root"
    root.mkdir()
    rng = np.random.default_rng(2)
    for namespace, sizes in ((fingerprint, (chunk, chunk // 2)), ("fp-free", (4096, 8192))):
        b = FsBackend(str(root), namespace, min_free_bytes=None)
        try:
            for i, size in enumerate(sizes):  # one frame of the layout's size, one not
                arena = rng.integers(0, 256, (1, size), dtype=np.uint8)
                assert b.store([key(i)], [0], arena, size).all_ok
            wrong = b.path_for(key(1))
        finally:
            b.close()
        if namespace == fingerprint:
            wrong_path = wrong
    code, report = cli_json("fsck", str(root), "--verify")
    by_fp = {n["fingerprint"]: n for n in report["namespaces"]}
    assert by_fp[fingerprint]["chunk_bytes"] == chunk and by_fp[fingerprint]["chunks"] == 1
    assert by_fp["fp-free"]["chunk_bytes"] is None and by_fp["fp-free"]["chunks"] == 2
    assert code == 1 and report["counts"] == {"wrong_size": 1}
    problem = report["problems"][0]
    assert problem["path"].endswith(os.path.basename(wrong_path))
    assert problem["detail"] == (f"chunk size: the frame holds {chunk // 2} bytes, the "
                                 f"namespace's layout {chunk}")
    code, text = run_cli("fsck", str(root))
    assert code == 1 and f"chunk size {chunk}" in text and "chunk size unknown" in text
    assert "wrong_size" in text
    code, report = cli_json("fsck", str(root), "--repair")
    assert code == 0 and report["repaired"] == 1 and not os.path.exists(wrong_path)
    code, report = cli_json("fsck", str(root), "--verify")
    assert code == 0 and report["chunks"] == 3


def test_fsck_calls_a_chunk_longer_than_its_frame_oversized_not_truncated(tmp_path):
    """Issue 28: a chunk with bytes appended, and a file at a chunk's name over 4 GiB
    (sparse), are ``oversized`` (they were reported "truncated"), with their sizes; a cut
    one stays ``truncated``; ``--repair`` removes all three. Also in a namespace whose
    chunk size is unknown (only the 4 GiB bound applies there)."""
    from shmtier.tiers.fs.backend import FsBackend

    fingerprint, chunk = _spec_fingerprint()
    root = tmp_path / "root"
    root.mkdir()
    rng = np.random.default_rng(3)
    planted = {}
    for namespace, size in ((fingerprint, chunk), ("fp-free", 4096)):
        b = FsBackend(str(root), namespace, min_free_bytes=None)
        try:
            arena = rng.integers(0, 256, (4, size), dtype=np.uint8)
            assert b.store([key(i) for i in range(4)], list(range(4)), arena, size).all_ok
            paths = [b.path_for(key(i)) for i in range(3)]
        finally:
            b.close()
        frame = os.path.getsize(paths[0])
        with open(paths[0], "ab") as f:
            f.write(b"\0" * 100)
        os.truncate(paths[1], frame // 2)
        os.truncate(paths[2], 5 << 30)
        planted[namespace] = paths, frame
    code, report = cli_json("fsck", str(root))
    assert code == 1 and report["counts"] == {"oversized": 4, "truncated": 2}, report["problems"]
    details = {p["path"]: (p["kind"], p["detail"], p["size"]) for p in report["problems"]}
    for namespace, (paths, frame) in planted.items():
        rel = [os.path.relpath(p, root) for p in paths]
        assert details[rel[0]] == ("oversized", f"length: {frame + 100} bytes, the frame has "
                                                f"{frame}", frame + 100)
        assert details[rel[1]][:2] == ("truncated", f"length: {frame // 2} bytes, the frame "
                                                    f"has {frame}")
        kind, detail, size = details[rel[2]]
        assert kind == "oversized" and size == 5 << 30
        assert detail.startswith(f"length: {5 << 30} bytes, more than any chunk of the layout")
    code, report = cli_json("fsck", str(root), "--verify", "--repair")
    assert code == 0 and report["repaired"] == 6
    assert not any(os.path.exists(p) for paths, _ in planted.values() for p in paths)
    code, report = cli_json("fsck", str(root), "--verify")
    assert code == 0 and report["chunks"] == 2


# ------------------------------------------------------------------ fsck: obj bucket

def test_fsck_of_an_obj_bucket(moto_s3, tmp_path):
    from shmtier.shared.codec import CompressionConfig
    from shmtier.tiers.backend import WorkerContext
    from shmtier.tiers.obj.backend import ObjBackend
    from shmtier.tiers.obj.config import ObjTierConfig

    bucket = moto_s3.new_bucket("fsck")
    entry = {"type": "obj", "store_config": moto_s3.store_config(bucket), "prefix": "kv"}
    cfg = tmp_path / "tier.json"
    cfg.write_text(json.dumps(entry))
    config = ObjTierConfig.from_options(
        {"store_config": entry["store_config"], "prefix": "kv", "io_threads": 2}, where="t")
    arena = np.random.default_rng(1).integers(0, 256, (6, 4096), dtype=np.uint8)
    b = ObjBackend.open(config, WorkerContext("fp-obj", 4096, 2, CompressionConfig()))
    c = moto_s3.client()
    try:
        assert b.store([key(i) for i in range(6)], list(range(6)), arena, 4096).all_ok
        assert main(["fsck", "--tier-config", str(cfg), "--verify"]) == 0
        body = lambda i: c.get_object(Bucket=bucket, Key=b.object_key(key(i)))["Body"].read()
        bad = bytearray(body(0))
        bad[-5] ^= 1
        c.put_object(Bucket=bucket, Key=b.object_key(key(0)), Body=bytes(bad))
        c.put_object(Bucket=bucket, Key=b.object_key(key(1)), Body=body(1)[:100])
        wrong_fan = f"{b.base}/fff/{key(2).hex()}.kv"
        c.put_object(Bucket=bucket, Key=wrong_fan, Body=body(2))
        c.put_object(Bucket=bucket, Key=f"{b.base}/abc/readme.txt", Body=b"hi")
        c.put_object(Bucket=bucket, Key="kv/vllm/0001.bin", Body=b"not ours")
        code, report = cli_json("fsck", "--tier-config", str(cfg))
        assert code == 1 and report["counts"] == {"truncated": 1, "misplaced": 1, "foreign": 1}
        assert report["other_entries"] == 1 and report["chunks"] == 5
        code, report = cli_json("fsck", "--tier-config", str(cfg), "--verify", "--repair")
        assert code == 0 and report["counts"] == {"corrupt": 1, "truncated": 1,
                                                  "misplaced": 1, "foreign": 1}
        assert report["chunks"] == 4
        left = {o["Key"] for o in c.list_objects_v2(Bucket=bucket)["Contents"]}
        assert "kv/vllm/0001.bin" in left and wrong_fan not in left
        assert b.object_key(key(0)) not in left and b.object_key(key(5)) in left
        # --bucket/--endpoint with credentials from boto3's chain
        env = {"AWS_ACCESS_KEY_ID": moto_s3.access_key,
               "AWS_SECRET_ACCESS_KEY": moto_s3.secret_key}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            code, report = cli_json("fsck", "--bucket", bucket, "--endpoint", moto_s3.endpoint,
                                    "--prefix", "kv")
        assert code == 0 and report["chunks"] == 4
        assert main(["fsck", "--bucket", "no-such-bucket-x", "--endpoint",
                     moto_s3.endpoint]) == 2
    finally:
        c.close()
        b.close()


def test_fsck_of_an_obj_bucket_finds_a_frame_of_another_chunk_size(moto_s3, tmp_path):
    from shmtier.shared.codec import CompressionConfig
    from shmtier.tiers.backend import WorkerContext
    from shmtier.tiers.obj.backend import ObjBackend
    from shmtier.tiers.obj.config import ObjTierConfig

    fingerprint, chunk = _spec_fingerprint()
    bucket = moto_s3.new_bucket("fsck-size")
    cfg = tmp_path / "tier.json"
    cfg.write_text(json.dumps({"type": "obj", "store_config": moto_s3.store_config(bucket)}))
    config = ObjTierConfig.from_options(
        {"store_config": moto_s3.store_config(bucket), "io_threads": 2}, where="t")
    arena = np.random.default_rng(3).integers(0, 256, (2, chunk), dtype=np.uint8)
    b = ObjBackend.open(config, WorkerContext(fingerprint, chunk, 2, CompressionConfig()))
    try:
        assert b.store([key(0)], [0], arena, chunk).all_ok
        assert b.store([key(1)], [1], arena, chunk // 2).all_ok  # another layout's size
        code, report = cli_json("fsck", "--tier-config", str(cfg))
        assert code == 1 and report["counts"] == {"wrong_size": 1}
        assert report["namespaces"][0]["chunk_bytes"] == chunk
        assert report["problems"][0]["path"] == b.object_key(key(1))
        code, report = cli_json("fsck", "--tier-config", str(cfg), "--verify", "--repair")
        assert code == 0 and report["repaired"] == 1 and report["chunks"] == 1
    finally:
        b.close()


# ------------------------------------------------------------------ top

def _step_times(e: Engine, keys: list, n: int) -> np.ndarray:
    """Seconds of n scheduler steps (a lookup of every key and on_schedule_end, under
    the manager's lock, as the connector makes them)."""
    m, ctx, out = e.manager, ReqContext("t"), []
    for _ in range(n):
        t = time.perf_counter()
        with m.lock:
            for k in keys:
                m.lookup(k, ctx)
            m.on_schedule_end(END)
        out.append(time.perf_counter() - t)
        time.sleep(0.002)
    return np.array(out)


def test_top_reads_a_live_engine_without_slowing_its_scheduler(engine_id, tmp_path):
    e = Engine(engine_id, tmp_path, chunks=16, workers=2)
    try:
        keys = [key(i) for i in range(10)]
        e.offload(keys, 0, ReqContext("a"))
        e.settle()
        got = subprocess.run([sys.executable, "-m", "shmtier", "top", engine_id, "--once",
                              "--json", "--interval", "0.1"], capture_output=True, text=True,
                             timeout=60)
        assert got.returncode == 0, got.stderr
        frame = json.loads(got.stdout)
        assert frame["alive"] and frame["rows"]["used"] == 10 and frame["rows"]["ready"] == 10
        assert frame["pool"]["mode"] == "spawn" and frame["tiers"][0]["type"] == "fs"
        assert frame["tiers"][0]["where"]["root_dir"] == str(tmp_path.resolve())
        workers = frame["workers"]
        assert [w["alive"] for w in workers] == [True, True]
        assert [w["lane"] for w in workers] == ["background", "promotion"]  # the default lanes
        assert sum(w["bytes"] for w in workers) == 10 * 8192  # the cascades' chunk bytes
        assert workers[1]["bytes"] == 0  # stores run in the background lane
        assert sum(w["jobs"] for w in workers) >= 2 and frame["rates"]["interval_s"] > 0
        assert all(w["job_depth"] == 0 and w["beat_age_s"] < 5 for w in workers)
        code, text = run_cli("top", engine_id, "--once", "--interval", "0.05")
        assert code == 0 and "rows   used 10/16" in text
        assert "pool   spawn, 2 workers (1 promotion)" in text
        assert re.search(r"^\s+1\s+\d+\s+alive\s+promotion\s", text, re.M), text

        # a reader at 10 Hz (the live JSON stream) against the scheduler's step times
        _step_times(e, keys, 50)  # warm
        alone = _step_times(e, keys, 300)
        reader = subprocess.Popen([sys.executable, "-m", "shmtier", "top", engine_id, "--json",
                                   "--interval", "0.1"], stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(reader.stdout.readline())["alive"]  # it runs
            watched = _step_times(e, keys, 300)
            frames = 1 + sum(1 for _ in iter(lambda: _ready_line(reader), None))
        finally:
            reader.terminate()
            reader.wait(10)
        a50, w50 = np.median(alone) * 1e6, np.median(watched) * 1e6
        a99, w99 = np.percentile(alone, 99) * 1e6, np.percentile(watched, 99) * 1e6
        print(f"\nstep p50 {a50:.1f} us alone, {w50:.1f} us with top at 10 Hz "
              f"({frames} frames); p99 {a99:.1f} / {w99:.1f} us")
        assert frames >= 5
        assert w50 < 2 * a50 + 50, (a50, w50)
    finally:
        e.close()
    assert main(["top", "no-such-engine-xyz", "--once"]) == 2


def _ready_line(proc) -> str | None:
    """A line the reader already wrote, or None (never waits)."""
    import select

    if select.select([proc.stdout], [], [], 0)[0]:
        return proc.stdout.readline() or None
    return None


# ------------------------------------------------------------------ metrics endpoint

def _scrape(url: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("shmtier_worker_") and "{" in line:
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            worker = labels.split('worker="')[1].split('"')[0]
            out[(name, worker)] = float(value)
    return out


def test_an_external_worker_dead_before_the_pool_saw_it_is_replaced(engine_id, tmp_path):
    """A `shmtier workers` process claims its slot and is SIGKILLed before any health
    check of the engine's pool saw it (no manager call in between: the engine idle, or
    its steps slow on a loaded host). Its slot still names it, and `shmtier workers`
    starts the next process only into a free slot: the pool must recover the slot (it
    used to count a start failure and leave it, so the worker was never replaced: CI,
    test_external_pool_serves_prometheus_metrics, "restarts_total 0" for 30 s)."""
    layout = KVLayout("m", "bfloat16", 16, 8192, 1)
    extra = {"cpu_bytes_to_use": 16 * 8192, "workers": "external", "num_tier_workers": 2,
             "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path),
                                  "min_free_bytes": None}]}
    manager = TieringOffloadingSpec(extra, layout, engine_id).get_manager()
    manager.lock.acquire()  # no health check of the pool meanwhile (the step-window
    locked = True           # thread's rounds take this lock too)
    pool = subprocess.Popen([sys.executable, "-m", "shmtier", "workers", "--engine-id",
                             engine_id], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:  # both slots claimed
            workers = snapshot(engine_id).workers
            if all(w.pid and w.alive for w in workers):
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.02)
        victim = workers[0].pid
        os.kill(victim, signal.SIGKILL)
        while snapshot(engine_id).workers[0].alive:  # reaped by `shmtier workers`
            assert time.monotonic() < deadline
            time.sleep(0.02)
        manager.lock.release()
        locked = False
        while True:  # the engine steps again: the slot recovered, a new process in it
            with manager.lock:
                manager.on_schedule_end(END)
            now = snapshot(engine_id).workers[0]
            if now.pid and now.pid != victim:
                break
            assert time.monotonic() < deadline, f"slot 0 still names pid {now.pid}"
            time.sleep(0.02)
        assert manager.tiers[0]._pool.broken is None
    finally:
        if locked:
            manager.lock.release()
        pool.terminate()
        pool.wait(15)
        manager.shutdown()


def test_external_pool_serves_prometheus_metrics(engine_id, tmp_path):
    layout = KVLayout("m", "bfloat16", 16, 8192, 1)
    extra = {"cpu_bytes_to_use": 16 * 8192, "workers": "external", "num_tier_workers": 2,
             "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path),
                                  "min_free_bytes": None}]}
    spec = TieringOffloadingSpec(extra, layout, engine_id)
    manager = spec.get_manager()
    pool = subprocess.Popen([sys.executable, "-m", "shmtier", "workers", "--engine-id",
                             engine_id, "--metrics-port", "0"], stdout=subprocess.PIPE,
                            text=True)
    try:
        first = pool.stdout.readline()
        assert "metrics on http://127.0.0.1:" in first, first
        url = first.split("metrics on ", 1)[1].strip()
        assert "2 tier workers" in pool.stdout.readline()
        rows = np.asarray(manager.primary.get_kv_memoryview())
        ctx = ReqContext("a")
        keys = [key(i) for i in range(8)]
        with manager.lock:
            out = manager.prepare_store(keys, ctx)
        rows[out.store_spec.chunk_ids] = np.arange(8, dtype=np.uint8)[:, None]
        with manager.lock:
            manager.complete_store(keys, ctx)

        def until(check, what, timeout_s=30.0):
            deadline = time.monotonic() + timeout_s
            while True:
                with manager.lock:
                    manager.on_schedule_end(END)
                    idle = not manager.has_pending_work()
                m = _scrape(url)
                if idle and check(m):
                    return m
                assert time.monotonic() < deadline, f"{what}: {m}"
                time.sleep(0.02)

        # both workers up: on a slow host (CI, under heavy I/O) one may still be starting
        # when the other has done every job
        m = until(lambda m: sum(v for (n, _), v in m.items()
                                if n == "shmtier_worker_bytes_total") == 8 * 8192
                  and all(m.get(("shmtier_worker_up", w)) == 1 for w in ("0", "1")),
                  "bytes, both workers up")
        for w in ("0", "1"):
            assert m[("shmtier_worker_restarts_total", w)] == 0
            assert m[("shmtier_worker_errors_total", w)] == 0
            assert m[("shmtier_worker_job_ring_depth", w)] == 0
            assert m[("shmtier_worker_heartbeat_age_seconds", w)] < 5
            assert ("shmtier_worker_codec_seconds_total", w) in m
        assert sum(m[("shmtier_worker_jobs_total", w)] for w in ("0", "1")) >= 2
        # a worker killed: the pool starts another; the slot's counters carry on
        victim = snapshot(engine_id).workers[0].pid
        os.kill(victim, signal.SIGKILL)
        m = until(lambda m: m[("shmtier_worker_restarts_total", "0")] == 1
                  and m[("shmtier_worker_up", "0")] == 1, "restart")
        assert sum(m[("shmtier_worker_bytes_total", w)] for w in ("0", "1")) == 8 * 8192
        del rows
    finally:
        pool.terminate()
        pool.wait(15)
        manager.shutdown()
