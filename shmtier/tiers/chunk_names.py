"""Names every tier that stores chunks under a namespace uses: the namespace's name per
layout fingerprint, a chunk's name per key, and which keys are usable at all.

Who uses it: the worker halves of the ``fs`` tier (file names, ``fs/namespace.py``) and
of the ``obj`` tier (object keys, ``obj/backend.py``), the CLI and tests. Any process;
pure functions, never block.
"""

from __future__ import annotations

import hashlib

NAMESPACE_PREFIX = "shmtier-"
CHUNK_SUFFIX = ".kv"
#: Longest key accepted: its hex name (200 chars + suffix) stays under NAME_MAX (255).
MAX_KEY_BYTES = 100


def namespace_dir_name(fingerprint: str) -> str:
    """Name of a layout fingerprint's namespace (a directory of the fs tier, a key prefix
    of the obj tier): ``shmtier-<16 hex of sha256>``."""
    return NAMESPACE_PREFIX + hashlib.sha256(fingerprint.encode("utf-8")).hexdigest()[:16]


def key_problem(key) -> str | None:
    """What makes ``key`` unusable as a chunk name (the INVALID detail), or None."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        return f"key is {type(key).__name__}, not bytes"
    n = len(key)
    if not 0 < n <= MAX_KEY_BYTES:
        return f"key length {n} (must be 1..{MAX_KEY_BYTES})"
    return None


def chunk_name(key: bytes) -> str:
    """A chunk's name: ``<key hex, lower case>.kv``."""
    return bytes(key).hex() + CHUNK_SUFFIX


def chunk_key(name: str) -> bytes | None:
    """The key a chunk name ``<key hex>.kv`` stands for, or None for any other name
    (also for one that ``chunk_name`` would not write: upper case or spaced hex)."""
    if not name.endswith(CHUNK_SUFFIX):
        return None
    digits = name[:-len(CHUNK_SUFFIX)]
    try:
        key = bytes.fromhex(digits)
    except ValueError:
        return None
    if key.hex() != digits:
        return None
    return key if 0 < len(key) <= MAX_KEY_BYTES else None
