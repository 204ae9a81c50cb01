"""Test hooks for tier worker processes: a test that puts this folder on PYTHONPATH
(the ``worker_hooks`` fixture of test_fs_accounting.py) before the engine spawns its
workers gets them, under the root ``SHMTIER_TEST_FS_ROOT`` only:

* ``SHMTIER_TEST_SLOW_PUBLISH_S``: each chunk file is published (renamed to its
  ``.kv`` name) that many seconds late, so a test can kill a worker mid-job.

Nothing else changes; without ``SHMTIER_TEST_FS_ROOT`` this module does nothing.
"""

import os

_ROOT = os.environ.get("SHMTIER_TEST_FS_ROOT")

if _ROOT:
    import time

    _SLOW = float(os.environ.get("SHMTIER_TEST_SLOW_PUBLISH_S") or 0)
    _rename = os.rename

    def _under_root(path) -> bool:
        return os.fspath(path).startswith(_ROOT)

    def rename(src, dst, *args, **kwargs):
        if _SLOW and _under_root(dst) and os.fspath(dst).endswith(".kv"):
            time.sleep(_SLOW)
        return _rename(src, dst, *args, **kwargs)

    os.rename = rename
