"""Waiting for a named POSIX IPC object (shared memory, semaphore) that another process
creates. Any process; blocks up to the caller's deadline, polling."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import posix_ipc

T = TypeVar("T")


def open_when_present(open_once: Callable[[], T], deadline: float, poll_s: float,
                      timeout_error: Callable[[], Exception]) -> T:
    """``open_once()`` as soon as the object exists; ``timeout_error()`` is raised when it
    still does not exist at ``deadline`` (``time.monotonic()``)."""
    while True:
        try:
            return open_once()
        except posix_ipc.ExistentialError:
            if time.monotonic() > deadline:
                raise timeout_error() from None
            time.sleep(poll_s)
