"""Suite-wide guards: every test must leave /dev/shm as it found it. Also the S3
servers' fixtures (``s3_servers.py``), defined here once so that the session-scoped
servers are shared by every test module, and the ``vllm`` marker on tests/vllm/."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from s3_servers import moto_faults, moto_s3, seaweedfs_s3, seaweedfs_s3_killable  # noqa: F401
from shmtier.shared import codec_choice
from shmtier.shared.segment import list_segments

SHM_DIR = "/dev/shm"
VLLM_TESTS = Path(__file__).parent / "vllm"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    """Every test under tests/vllm/ gets the ``vllm`` marker (setup.cfg), so that
    ``scripts/test -m vllm`` selects them; tests elsewhere that need vLLM carry it
    themselves."""
    for item in items:
        if VLLM_TESTS in item.path.parents:
            item.add_marker(pytest.mark.vllm)


def _shmtier_entries() -> set[str]:
    try:
        return {e for e in os.listdir(SHM_DIR) if "shmtier" in e}
    except FileNotFoundError:
        return set()


def _foreign(entries: set[str]) -> set[str]:
    """Segments held by another live process (a concurrent test run), and their ring
    semaphores: not ours to judge."""
    me = os.getpid()
    live = {s.name.lstrip("/") for s in list_segments()
            if s.alive and me not in (s.owner_pid, s.creator_pid)}
    return {e for e in entries if e in live or any(e.startswith(f"sem.{seg}.") for seg in live)}


@pytest.fixture(autouse=True)
def no_shm_leak():
    """Fail the test that leaves a shmtier segment or semaphore behind (and remove it).

    A new entry counts as this test's leak when this process holds it or its
    holder is dead (a killed child, a crashed worker)."""
    before = _shmtier_entries()
    yield
    new = _shmtier_entries() - before
    leaked = new - _foreign(new)
    for entry in leaked:
        try:
            os.unlink(os.path.join(SHM_DIR, entry))
        except FileNotFoundError:
            pass
    assert not leaked, f"test left shared memory behind: {sorted(leaked)}"


@pytest.fixture
def engine_id() -> str:
    """A unique engine id, so tests never share a segment by accident."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def idle_host(monkeypatch):
    """Compression by cost (``shmtier/shared/codec_choice.py``) in this process sees a host
    with CPU to spare, whatever the machine's load, so codec mode "auto" compresses when
    not behind (its rule 3). For tests whose subject is what a compressed frame holds:
    on a busy host "auto" rightly stores raw, and the choice itself is tested with
    given inputs in test_codec_choice.py. Applies to choosers made after it (each takes
    the process's host view when built); tier worker processes keep their own."""
    host = codec_choice.HostCpu()
    host.idle_cores, host.share = float(os.cpu_count() or 1), 1.0
    monkeypatch.setattr(host, "update", lambda: None)
    monkeypatch.setattr(codec_choice, "_host", host)
    return host
