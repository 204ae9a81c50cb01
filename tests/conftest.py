"""Suite-wide guards: every test must leave /dev/shm as it found it, and no p2p socket
directory of a dead engine of this session in the temp dir. Also the S3
servers' fixtures (``s3_servers.py``), defined here once so that the session-scoped
servers are shared by every test module, and the ``vllm`` marker on tests/vllm/."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from s3_servers import moto_faults, moto_s3, seaweedfs_s3, seaweedfs_s3_killable  # noqa: F401
from shmtier.shared import codec_choice
from shmtier.shared.ring_tools import ring_semaphore_segment
from shmtier.shared.segment import NAME_PREFIX
from shmtier.shared.segment_tools import list_segments
from shmtier.tiers.node.layout import pool_of
from shmtier.tiers.node.tools import list_pools
from shmtier.tiers.p2p import socket_dirs

SHM_DIR = "/dev/shm"
VLLM_TESTS = Path(__file__).parent / "vllm"
#: This test session's engine-id prefix: every ``engine_id`` the fixture gives carries it,
#: so the leak check can tell this session's segments from another suite's on the host.
SESSION_PREFIX = f"test-{uuid.uuid4().hex[:8]}-"


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


def _leaks(entries: set[str]) -> set[str]:
    """The entries (segments and their ring semaphores, node pools) among ``entries`` that
    this session leaked: those whose segment this process holds (whatever its name), and
    those named with ``SESSION_PREFIX`` unless another live process holds their segment (a
    child of this session still winding down) - a dead holder there is a killed child or
    a crashed worker of this session. A node pool counts when this process is an engine in
    it, or when its pool name has ``SESSION_PREFIX`` and no live engine is in it. Another
    suite's entries on the same host (another prefix) are never judged, even when their
    holder is dead."""
    me = os.getpid()
    status = {s.name.lstrip("/"): s for s in list_segments()}
    pools = {p.pool: p for p in list_pools()}
    ours = NAME_PREFIX + SESSION_PREFIX
    leaked = set()
    for entry in entries:
        pool = pool_of(entry)
        if pool is not None:  # a node pool: judged by the live engines in it
            live = [pid for _, pid, alive in pools[pool].engines if alive] if pool in pools else []
            if me in live or (pool.startswith(SESSION_PREFIX) and not live):
                leaked.add(entry)
            continue
        segment = entry if entry.startswith(NAME_PREFIX) else ring_semaphore_segment(entry)
        held = status.get(segment) if segment else None
        if held is not None and held.alive:
            if me in (held.owner_pid, held.creator_pid):
                leaked.add(entry)
        elif segment.startswith(ours) if segment else ours in entry:
            leaked.add(entry)
    return leaked


@pytest.fixture(autouse=True)
def no_shm_leak():
    """Fail the test that leaves a shmtier segment or semaphore behind (and remove it).

    A new entry counts as this test's leak when this process holds it, or when it is
    named with this session's prefix (``SESSION_PREFIX``, the ``engine_id`` fixture's)
    and its holder is dead (a killed child, a crashed worker) or gone. Entries of other
    suites running on the host are not this test's, whatever their state."""
    before = _shmtier_entries()
    yield
    new = _shmtier_entries() - before
    leaked = _leaks(new)
    for entry in leaked:
        try:
            os.unlink(os.path.join(SHM_DIR, entry))
        except FileNotFoundError:
            pass
    assert not leaked, f"test left shared memory behind: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def no_p2p_socket_dir_leak():
    """Fail the test that leaves a p2p socket directory of a dead engine of this session
    (``engine_id`` fixture's prefix) behind (and remove it): the engine's shutdown, its
    endpoint or its segment guardian removes it (shmtier/tiers/p2p/socket_dirs.py)."""
    yield
    ours = {path for path in socket_dirs.stale()
            if socket_dirs.engine_of(path).startswith(SESSION_PREFIX)}
    for path in ours:
        shutil.rmtree(path, ignore_errors=True)
    assert not ours, f"test left p2p socket directories of dead engines behind: {sorted(ours)}"


WORKER_HOOKS = Path(__file__).parent / "worker_hooks"


@pytest.fixture
def worker_hooks(monkeypatch):
    """``install(**settings)``: the tier workers spawned from then on (by this process or
    its children, through the environment) load tests/worker_hooks/sitecustomize.py, with
    ``settings`` as its ``SHMTIER_TEST_<NAME>`` variables (``fs_root=path`` sets
    ``SHMTIER_TEST_FS_ROOT``; names and meanings: that module's docstring)."""

    def install(**settings: object) -> None:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            p for p in (str(WORKER_HOOKS), os.environ.get("PYTHONPATH")) if p))
        for name, value in settings.items():
            monkeypatch.setenv(f"SHMTIER_TEST_{name.upper()}", str(value))

    return install


@pytest.fixture
def engine_id() -> str:
    """A unique engine id, so tests never share a segment by accident; it carries this
    session's prefix (``SESSION_PREFIX``), by which the leak check knows its segments."""
    return f"{SESSION_PREFIX}{uuid.uuid4().hex[:12]}"


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
