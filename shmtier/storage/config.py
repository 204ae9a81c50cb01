"""Options every storage tier takes (any process): ``fs`` and ``obj`` configs extend
:class:`StorageTierConfig`, which the storage scheduler half reads
(``shmtier/storage/scheduler.py``) and whose frame options (MAC key, a
``max_bytes`` that holds one chunk's frame) every storage tier's workers use.

Who calls: the tier config classes when the spec is built, in any process. Pure but
for a MAC key file, read by its check (a few system calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shmtier.options import (
    ConfigError,
    Secret,
    boolean,
    choice_upper,
    integer,
    number,
    secret_file,
    secret_hex,
)
from shmtier.shared.codec import MAC_KEY_BYTES, frame_header_size
from shmtier.tiers.config import TierConfig, TierContext, option

DEFAULT_PROBE_TTL_S = 0.25
DEFAULT_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True, kw_only=True)
class StorageTierConfig(TierConfig):
    """``max_bytes``: bytes the tier keeps on its medium at most (None: unbounded), at
    least one chunk's frame. ``locality``: "LOCAL" or "REMOTE" (request filters,
    backpressure defaults). ``enable_kv_events``: stored/evicted events for this tier.
    ``max_pinned_fraction``: at most this share of the CPU tier's rows may be pinned by
    this tier's queued cascades; the chunks of cascades beyond it wait unpinned (the CPU
    tier may evict them meanwhile: counted lost) in a queue of as many chunks, which go
    oldest first as pinned rows complete; what overflows that queue is dropped and counted
    as backpressure.

    Sharing the medium with other engines: ``probe_unknown`` (default true): a key the
    tier's index does not know is looked for on the medium by a worker (RETRY until
    the answer; false: the medium is this engine's alone, such a key is a MISS at
    once). ``probe_ttl_s``: a key found absent answers MISS without a new probe until
    no lookup asked for it for this long. ``probe_timeout_s``: a probe not answered by
    then answers MISS.

    ``mac_key_file`` / ``mac_key`` (at most one; default neither): the secret of the
    frames' keyed MAC (``shmtier/shared/codec.py``, "Authentication"), from a private
    file (read here, when the spec is built) or as hex in the config (which gets
    logged: prefer the file). Either is kept as a :class:`~shmtier.options.Secret` that
    never shows its value; the tier workers receive the key bytes as ``mac_key`` in
    ``worker_args`` (published in the engine's 0600 shared-memory segment, like every
    worker option) and no file path, so every worker uses the key checked here."""

    #: What one chunk's frame is on this medium, in errors ("file", "object").
    frame_word: ClassVar[str] = "frame"

    max_bytes: int | None = option(None, integer(1).or_none("null (unbounded)"), worker=True)
    locality: str | None = option(None, choice_upper("LOCAL", "REMOTE").or_none())
    enable_kv_events: bool = option(False, boolean())
    max_pinned_fraction: float = option(0.5, number(0, 1, min_open=True))
    probe_unknown: bool = option(True, boolean())
    probe_ttl_s: float = option(DEFAULT_PROBE_TTL_S, number(0, 3600, min_open=True))
    probe_timeout_s: float = option(DEFAULT_PROBE_TIMEOUT_S, number(0, 3600, min_open=True))
    mac_key_file: Secret | None = option(None, secret_file(*MAC_KEY_BYTES).or_none())
    mac_key: Secret | None = option(
        None, secret_hex(*MAC_KEY_BYTES, source="mac_key").or_none())

    @property
    def mac_secret(self) -> bytes | None:
        """The MAC key's bytes (from ``mac_key_file`` or ``mac_key``), or None."""
        secret = self.mac_key_file or self.mac_key
        return secret.value if secret is not None else None

    def worker_args(self) -> dict[str, Any]:
        """The ``worker=True`` options, plus ``mac_key`` (the key's bytes) when a MAC key
        is configured: the workers get the key checked here, never a path."""
        args = super().worker_args()
        if self.mac_secret is not None:
            args["mac_key"] = self.mac_secret
        return args

    def check_together(self, where: str, context: TierContext) -> None:
        """At most one of ``mac_key_file`` and ``mac_key``; ``max_bytes`` (None:
        unbounded) at least one chunk's frame."""
        if self.mac_key_file is not None and self.mac_key is not None:
            raise ConfigError(
                f"{where}.mac_key_file and {where}.mac_key are both set: give the MAC key "
                f"one way (a file is preferred: configs get logged)")
        if self.max_bytes is None or context.chunk_bytes is None:
            return
        one = context.chunk_bytes + frame_header_size(context.key_bytes or 0,
                                                      mac=self.mac_secret is not None)
        if self.max_bytes < one:
            raise ConfigError(
                f"{where}.max_bytes = {self.max_bytes!r} is invalid: expected at least one "
                f"chunk's {self.frame_word} ({one} bytes: {context.chunk_bytes} bytes of KV "
                f"and the frame header), or null (unbounded)")
