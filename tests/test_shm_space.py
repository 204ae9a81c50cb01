"""A /dev/shm too small for the CPU tier: a ConfigError naming the key, never SIGBUS.

The small-/dev/shm scenarios run in a child process inside a private mount
namespace (``unshare -m``, or ``unshare -rm`` when not root) with a tmpfs of a
few MiB mounted on /dev/shm; the child lists that tmpfs before it exits, so
"nothing left behind" is checked where the segment lived. Skipped where such a
namespace cannot be made (no unshare, no CAP_SYS_ADMIN, user namespaces off).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from shmtier.config import ConfigError, KVLayout
from shmtier.shared.layout import SegmentLayout
from shmtier.shared.pool_config import rings_len_for
from shmtier.spec import TieringOffloadingSpec

MiB = 1 << 20
LAYOUT = KVLayout("m", "bfloat16", 16, 64 * 1024, 1)  # 64 KiB rows
UNSHARE = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-m"]
MOUNT_FAILED = 99

# Runs each attempt in turn; prints one JSON line: per attempt the error (type: message) or
# what /dev/shm held once it was created, then what /dev/shm holds at the end.
CHILD = r"""
import json, os, sys
sys.modules["vllm"] = None  # 3-4 s of import that nothing here needs
from shmtier.config import KVLayout
from shmtier.spec import TieringOffloadingSpec
from shmtier.shared import segment as seg
from shmtier.shared.layout import ArenaGeometry

args = json.loads(sys.argv[1])
results, suggested = [], None
for attempt in args["attempts"]:
    result = {}
    try:
        if attempt["role"] == "segment":  # the kernel's refusal alone (space check bypassed)
            seg.shm_free_bytes = lambda shm_dir=seg.SHM_DIR: None
            g = ArenaGeometry(attempt["cpu"] // 65536, 65536, 65536, 1)
            seg.open_segment("space", g, "fp", owner=True).close()
            result["created"] = True
            results.append(result)
            continue
        cpu = suggested if attempt["cpu"] == "suggested" else attempt["cpu"]
        extra = dict(args.get("extra", {}), cpu_bytes_to_use=cpu)
        spec = TieringOffloadingSpec(extra, KVLayout(*args["layout"]), "space")
        if attempt["role"] == "manager":
            manager = spec.get_manager()
            result["created"] = sorted(os.listdir("/dev/shm"))
            manager.shutdown()
        else:  # a GPU worker arriving first creates the segment
            spec.get_worker(None, 0)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        if "at most " in str(e):
            suggested = int(str(e).split("at most ")[1].split()[0])
    results.append(result)
print(json.dumps({"results": results, "left": sorted(os.listdir("/dev/shm"))}), flush=True)
"""


@functools.cache
def _namespace_problem() -> str | None:
    """Why a private /dev/shm cannot be made here (None: it can)."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    try:
        probe = subprocess.run(
            UNSHARE + ["sh", "-c", "mount -t tmpfs -o size=1m none /dev/shm"],
            capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if probe.returncode:
        return (f"{' '.join(UNSHARE)} + mount of a tmpfs is not permitted here: "
                f"{probe.stderr.strip()}")
    return None


def _run_in_small_shm(size: str, attempts: list[dict], extra: dict | None = None) -> dict:
    """Run ``attempts`` in a child whose /dev/shm is a fresh tmpfs of ``size``."""
    problem = _namespace_problem()
    if problem:
        pytest.skip(f"needs a private mount namespace with a tmpfs on /dev/shm: {problem}")
    args = {"attempts": attempts, "extra": extra or {},
            "layout": [LAYOUT.model, LAYOUT.dtype, LAYOUT.gpu_block_size,
                       LAYOUT.worker_kv_bytes_per_block, LAYOUT.world_size]}
    script = f'mount -t tmpfs -o size="$1" none /dev/shm || exit {MOUNT_FAILED}; shift; exec "$@"'
    child = subprocess.run(
        UNSHARE + ["sh", "-c", script, "sh", size, sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True, text=True, timeout=120)
    if child.returncode == MOUNT_FAILED:
        pytest.skip(f"cannot mount a tmpfs of size={size} on /dev/shm here: {child.stderr.strip()}")
    # SIGBUS in the child shows as -7 (or 135 through the shell): the bug this file guards
    assert child.returncode == 0, (
        f"child died with {child.returncode}: {child.stderr[-2000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _segment_size(extra: dict) -> int:
    spec = TieringOffloadingSpec(extra, LAYOUT, "space")
    rings_len = rings_len_for(spec.pool_config) if spec.pool_config else 0
    return SegmentLayout.for_geometry(spec.geometry, rings_len).total_len


def _assert_names_key_size_and_free(error: str, cpu: int, size: int, free: int) -> None:
    assert error.startswith("ConfigError: "), error
    assert f"kv_connector_extra_config['cpu_bytes_to_use'] = {cpu} " in error, error
    assert f"needs {size} bytes" in error, error
    assert f"/dev/shm has {free} bytes" in error, error
    assert "--shm-size" in error and "Nothing was created" in error, error


@pytest.mark.parametrize("role", ["manager", "worker"])
def test_cpu_tier_larger_than_dev_shm_is_a_config_error(role):
    """128 MiB CPU tier, 64 MiB /dev/shm (Docker's default): the scheduler or a GPU worker,
    whichever creates the segment, fails naming the key; the tmpfs is left empty."""
    out = _run_in_small_shm("64m", [{"role": role, "cpu": 128 * MiB}])
    (result,) = out["results"]
    _assert_names_key_size_and_free(result["error"], 128 * MiB,
                                    _segment_size({"cpu_bytes_to_use": 128 * MiB}), 64 * MiB)
    assert out["left"] == []


def test_ring_semaphores_are_counted_and_the_suggested_size_fits(tmp_path):
    """With tier workers the ring semaphores need /dev/shm pages too; the value the error
    suggests creates the segment and every semaphore, and shutdown leaves nothing.
    (External workers: the scheduler makes the rings, nobody has to start.)"""
    extra = {"secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}],
             "workers": "external", "num_tier_workers": 2}
    out = _run_in_small_shm("64m", [{"role": "manager", "cpu": 128 * MiB},
                                    {"role": "manager", "cpu": "suggested"}], extra)
    refused, created = out["results"]
    _assert_names_key_size_and_free(
        refused["error"], 128 * MiB, _segment_size(dict(extra, cpu_bytes_to_use=128 * MiB)),
        64 * MiB)
    assert "ring semaphores" in refused["error"]
    assert "error" not in created, created
    assert "shmtier_space" in created["created"]
    assert sum(e.startswith("sem.shmtier_space.") for e in created["created"]) == 8
    assert out["left"] == []


def test_fallocate_refuses_when_the_free_space_check_is_bypassed():
    """The kernel's own refusal (posix_fallocate: ENOSPC) is a SegmentSpaceError too, never
    a SIGBUS at a later page fault; the half-made object is unlinked."""
    out = _run_in_small_shm("8m", [{"role": "segment", "cpu": 16 * MiB}])
    (result,) = out["results"]
    assert result["error"].startswith("SegmentSpaceError: segment /shmtier_space needs "), result
    assert "on /dev/shm, which has" in result["error"]
    assert out["left"] == []


def test_tmpfs_without_a_size_limit_is_bounded_by_memory():
    """A tmpfs mounted with size=0 reports no blocks: the bound is the host's memory."""
    out = _run_in_small_shm("0", [{"role": "manager", "cpu": 1 << 50}])
    (result,) = out["results"]
    assert result["error"].startswith("ConfigError: "), result
    assert f"['cpu_bytes_to_use'] = {1 << 50} " in result["error"]
    assert out["left"] == []


@pytest.mark.parametrize("role", ["manager", "worker"])
def test_absurd_cpu_bytes_names_the_key(role, engine_id):
    """cpu_bytes_to_use = 2**50: a ConfigError naming key, size and free space (was a bare
    OSError: Cannot allocate memory from mmap); nothing is left in /dev/shm."""
    spec = TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 50}, LAYOUT, engine_id)
    size = _segment_size({"cpu_bytes_to_use": 1 << 50})
    with pytest.raises(ConfigError) as info:
        spec.get_manager() if role == "manager" else spec.get_worker(None, 0)
    message = str(info.value)
    assert f"kv_connector_extra_config['cpu_bytes_to_use'] = {1 << 50} " in message
    assert f"needs {size} bytes (1.0 PiB)" in message
    assert re.search(r"/dev/shm has \d+ bytes \([0-9.]+ [KMGT]iB\) free", message), message
    assert not os.path.exists(f"/dev/shm/shmtier_{engine_id}")
