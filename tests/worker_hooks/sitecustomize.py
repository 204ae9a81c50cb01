"""Test hooks for tier worker processes: a test that puts this folder on PYTHONPATH
(the ``worker_hooks`` fixture of tests/conftest.py) before the engine spawns its
workers gets them. Every Python process started with that environment loads this
module, so each hook says which processes it applies to.

* ``SHMTIER_TEST_PROCESS_LOG``: every process appends a line ``<pid> hooked <argv>`` to
  that file at its start, and a line ``<pid> <event> <args>`` for each process it starts
  (Python's audit events: ``subprocess.Popen``, ``os.posix_spawn``, ``os.fork``,
  ``os.system``, ...), so a test can tell what a worker started.

* ``SHMTIER_TEST_SLOW_TALLY_S``: a worker's every add to its slot's counters
  (``WorkerRings.tally``) waits that many seconds first, so a test can tell whether a
  result is counted before or after it is answered.

Under the root ``SHMTIER_TEST_FS_ROOT`` only:

* ``SHMTIER_TEST_SLOW_PUBLISH_S``: each chunk file is published (renamed to its
  ``.kv`` name) that many seconds late, so a test can kill a worker mid-job;
* ``SHMTIER_TEST_FS_CAPACITY``: ``os.statvfs`` reports a filesystem of that many
  bytes, as full as the files under the root make it (a small filesystem, for the
  free-space floor);
* ``SHMTIER_TEST_PAGE_CACHE_MEASURE``: every buffered write counts as expensive and a
  measure of ``page_cache_bytes: "auto"`` is that many bytes (its bound at least one
  byte), so a worker's auto window closes after its first few files.

Nothing else changes; without these variables this module does nothing.
"""

import os
import sys

_PROCESS_LOG = os.environ.get("SHMTIER_TEST_PROCESS_LOG")

if _PROCESS_LOG:
    # the audit events that start a process on Linux (os.posix_spawnp raises
    # os.posix_spawn's; os.spawn* fork, then exec)
    _STARTS_A_PROCESS = frozenset(("subprocess.Popen", "os.posix_spawn", "os.fork",
                                   "os.forkpty", "os.system", "os.exec"))

    def _log_process_line(what: str) -> None:
        with open(_PROCESS_LOG, "a") as f:  # one write per line: lines of processes never mix
            f.write(f"{os.getpid()} {what}"[:1000].replace("\n", " ") + "\n")

    def _log_process_starts(event, args):
        if event in _STARTS_A_PROCESS:
            _log_process_line(f"{event} {args!r}")

    with open("/proc/self/cmdline", "rb") as _f:  # sys.argv is not set yet here
        _argv = _f.read().split(b"\0")[:-1]
    _log_process_line(f"hooked {_argv!r}")
    sys.addaudithook(_log_process_starts)

_SLOW_TALLY = float(os.environ.get("SHMTIER_TEST_SLOW_TALLY_S") or 0)

if _SLOW_TALLY:
    import time as _time

    from shmtier.shared.ring import WorkerRings

    _tally = WorkerRings.tally

    def _slow_tally(self, *args, **kwargs):
        _time.sleep(_SLOW_TALLY)
        return _tally(self, *args, **kwargs)

    WorkerRings.tally = _slow_tally

_ROOT = os.environ.get("SHMTIER_TEST_FS_ROOT")

if _ROOT:
    import time

    _SLOW = float(os.environ.get("SHMTIER_TEST_SLOW_PUBLISH_S") or 0)
    _CAPACITY = int(os.environ.get("SHMTIER_TEST_FS_CAPACITY") or 0)
    _rename = os.rename
    _statvfs = os.statvfs

    def _path(path, dir_fd=None) -> str:
        """The path ``path`` names: an open descriptor's, or relative to ``dir_fd``'s
        (the fs tier opens everything relative to directory descriptors)."""
        if isinstance(path, int):
            return os.readlink(f"/proc/self/fd/{path}")
        path = os.fspath(path)
        if dir_fd is not None and not os.path.isabs(path):
            return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return path

    def _under_root(path, dir_fd=None) -> bool:
        return _path(path, dir_fd).startswith(_ROOT)

    def rename(src, dst, *args, **kwargs):
        target = _path(dst, kwargs.get("dst_dir_fd"))
        if _SLOW and target.startswith(_ROOT) and target.endswith(".kv"):
            time.sleep(_SLOW)
        return _rename(src, dst, *args, **kwargs)

    def _used() -> int:
        used = 0
        for top, _dirs, files in os.walk(_ROOT):
            for name in files:
                try:
                    used += os.lstat(os.path.join(top, name)).st_size
                except OSError:
                    pass
        return used

    def statvfs(path):
        real = _statvfs(path)
        if not (_CAPACITY and _under_root(path)):
            return real
        free = max(0, _CAPACITY - _used())
        # bsize, frsize, blocks, bfree, bavail, files, ffree, favail, flag, namemax
        return os.statvfs_result((1, 1, _CAPACITY, free, free, real.f_files, real.f_ffree,
                                  real.f_favail, real.f_flag, real.f_namemax))

    os.rename = rename
    os.statvfs = statvfs

    _MEASURE = int(os.environ.get("SHMTIER_TEST_PAGE_CACHE_MEASURE") or 0)
    if _MEASURE:
        from shmtier.tiers.fs import writeback

        writeback.AUTO_EXPENSIVE_S_PER_GIB = -1.0
        writeback.AUTO_MEASURE_BYTES = _MEASURE
        writeback.AUTO_MIN_BYTES = 1
