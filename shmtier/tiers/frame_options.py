"""Options every tier that stores codec frames shares (``fs``, ``obj``): the frames' MAC
key and the smallest ``max_bytes`` that holds one chunk's frame.

Who calls: the tier config classes (``fs/config.py``, ``obj/config.py``) when the spec is
built, in any process. Pure: a MAC key file is read by its check (a few system calls).

A config declares the two MAC fields with these factories::

    mac_key_file: Secret | None = mac_key_file_option()
    mac_key: Secret | None = mac_key_option()

and calls :func:`check_frame_options` from its ``check_together`` and
:func:`with_mac_key` from its ``worker_args``.
"""

from __future__ import annotations

from typing import Any

from shmtier.options import ConfigError, Secret, secret_file, secret_hex
from shmtier.shared.codec import MAC_KEY_BYTES, frame_header_size
from shmtier.tiers.config import TierContext, option


def mac_key_file_option() -> Any:
    """``mac_key_file``: a private file holding the frames' MAC key (read when the spec
    is built), or null."""
    return option(None, secret_file(*MAC_KEY_BYTES).or_none())


def mac_key_option() -> Any:
    """``mac_key``: the frames' MAC key as hex in the config (it gets logged: prefer the
    file), or null."""
    return option(None, secret_hex(*MAC_KEY_BYTES, source="mac_key").or_none())


def mac_secret(config: Any) -> bytes | None:
    """The MAC key's bytes of ``config`` (from ``mac_key_file`` or ``mac_key``), or None."""
    secret: Secret | None = config.mac_key_file or config.mac_key
    return secret.value if secret is not None else None


def with_mac_key(config: Any, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` (a config's ``worker=True`` options) plus ``mac_key`` (the key's bytes)
    when a MAC key is configured: the workers get the key checked here, never a path."""
    key = mac_secret(config)
    if key is not None:
        args["mac_key"] = key
    return args


def check_frame_options(config: Any, where: str, context: TierContext, *,
                        what: str = "file") -> None:
    """At most one of ``mac_key_file`` and ``mac_key``; ``max_bytes`` (None: unbounded)
    at least one chunk's frame (``what`` names it: a chunk's file, object...)."""
    if config.mac_key_file is not None and config.mac_key is not None:
        raise ConfigError(
            f"{where}.mac_key_file and {where}.mac_key are both set: give the MAC key "
            f"one way (a file is preferred: configs get logged)")
    max_bytes = config.max_bytes
    if max_bytes is None or context.chunk_bytes is None:
        return
    one = context.chunk_bytes + frame_header_size(context.key_bytes or 0,
                                                  mac=mac_secret(config) is not None)
    if max_bytes < one:
        raise ConfigError(
            f"{where}.max_bytes = {max_bytes!r} is invalid: expected at least one "
            f"chunk's {what} ({one} bytes: {context.chunk_bytes} bytes of KV and the "
            f"frame header), or null (unbounded)")
