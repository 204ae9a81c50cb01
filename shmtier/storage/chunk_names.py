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


def is_namespace_name(name: str) -> bool:
    """Whether ``name`` has the form of a namespace's name (``namespace_dir_name``)."""
    digits = name[len(NAMESPACE_PREFIX):]
    return (name.startswith(NAMESPACE_PREFIX) and len(digits) == 16
            and all(c in "0123456789abcdef" for c in digits))


#: How a namespace's fingerprint names the MAC key its frames carry tags of.
MAC_MARK = "|mac="


def with_mac_id(fingerprint: str, key_id: str | None) -> str:
    """The namespace fingerprint of a layout ``fingerprint`` whose frames carry MAC tags
    of the key with id ``key_id`` (``codec.mac_key_id``); ``fingerprint`` itself for None:
    engines with another key, or none, never share a namespace."""
    return fingerprint if key_id is None else f"{fingerprint}{MAC_MARK}{key_id}"


def mac_id_of(namespace_fingerprint: str) -> str | None:
    """The MAC key id a namespace fingerprint names (``with_mac_id``), or None."""
    _, mark, key_id = namespace_fingerprint.rpartition(MAC_MARK)
    return key_id if mark else None


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
