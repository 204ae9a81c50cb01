"""Tier backends: the worker half of each secondary tier (the I/O for one medium).

Runs in tier worker processes only. ``base`` defines the interface the job loop calls
(:class:`TierBackend`, :class:`BatchResult`, the per-key outcome vocabulary); one module
per medium implements it (``fs``: files under a directory tree). Importing this package
is cheap; a backend module is imported when its class is asked for.
"""

from shmtier.workers.backends.base import (  # noqa: F401
    CORRUPT,
    ERROR,
    EXISTS,
    FULL,
    INVALID,
    MISSING,
    OK,
    OUTCOME_KINDS,
    SUCCESS_KINDS,
    BatchResult,
    ScanEntry,
    TierBackend,
    outcome_kind,
)


def __getattr__(name: str):
    if name == "FsBackend":
        from shmtier.workers.backends.fs import FsBackend

        return FsBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
