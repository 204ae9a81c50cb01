"""The test S3 servers themselves (tests/s3_servers.py): what they leave on the machine."""

from __future__ import annotations

import os
import tempfile

from s3_servers import seaweedfs_s3  # noqa: F401


def _log_files_of(directory: str, pid: int) -> list[str]:
    """glog's files of process ``pid`` in ``directory`` (``weed.<host>.<user>.log.<LEVEL>.<time>.<pid>``)."""
    return [name for name in os.listdir(directory)
            if name.startswith("weed.") and name.endswith(f".{pid}")]


def test_seaweedfs_writes_its_log_files_into_its_own_dir(seaweedfs_s3):  # noqa: F811
    """So ``close()``, which removes that dir, removes them too (glog's default is the
    system temp dir, where every run's files used to stay)."""
    pid = seaweedfs_s3.proc.pid
    assert _log_files_of(seaweedfs_s3.dir, pid), os.listdir(seaweedfs_s3.dir)
    assert _log_files_of(tempfile.gettempdir(), pid) == []
