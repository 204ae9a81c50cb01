"""Suite-wide guards: every test must leave /dev/shm as it found it."""

from __future__ import annotations

import os
import uuid

import pytest

SHM_DIR = "/dev/shm"


def _shmtier_entries() -> set[str]:
    try:
        return {e for e in os.listdir(SHM_DIR) if "shmtier" in e}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_shm_leak():
    """Fail the test that leaves a shmtier segment or semaphore behind (and remove it)."""
    before = _shmtier_entries()
    yield
    leaked = _shmtier_entries() - before
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
