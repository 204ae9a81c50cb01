"""Options every storage tier takes (any process): ``fs`` and ``obj`` configs extend
:class:`StorageTierConfig`, which the storage scheduler half reads
(``shmtier/storage/scheduler.py``) and whose frame options (MAC key, a
``max_bytes`` that holds one chunk's frame) every storage tier's workers use.

Who calls: the tier config classes when the spec is built, in any process (and, as
plain data back into this frozen config, the tier workers: ``Options.from_dict``). Pure
but for a MAC key file, read by its check (a few system calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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


@dataclass(frozen=True, kw_only=True)
class StorageTierConfig(TierConfig):
    """What every storage tier (a medium shared by engines: a filesystem root, a bucket)
    takes. The MAC key (``mac_key_file`` or ``mac_key``, at most one) is kept as a
    :class:`~shmtier.options.Secret` that never shows its value; the tier workers
    receive its bytes with the rest of this config (``to_dict``, published in the
    engine's 0600 shared-memory segment) and no file path, so every worker uses the key
    checked here. The frames' keyed MAC: ``shmtier/shared/codec.py``, "Authentication"."""

    #: What one chunk's frame is on this medium, in errors ("file", "object").
    frame_word: ClassVar[str] = "frame"

    max_bytes: int | None = option(
        None, integer(1).or_none("null (unbounded)"),
        doc="bytes this engine keeps on the medium at most, at least one chunk's frame; "
            "never exceeded (stores in flight reserve their largest frame), least recently "
            "used chunks evicted; engines sharing a medium bound only what each stores")
    locality: str | None = option(
        None, choice_upper("LOCAL", "REMOTE").or_none(),
        doc="for vLLM's kv_load_tiers request filters and the backpressure defaults")
    enable_kv_events: bool = option(
        False, boolean(), doc="emit stored/evicted KV events for this tier (needs vLLM's KV "
                              "events enabled)")
    max_pinned_fraction: float = option(
        0.5, number(0, 1, min_open=True),
        doc="at most this share of the CPU tier's rows may wait pinned for this tier's "
            "cascades; further cascades wait unpinned in a queue of as many chunks (the CPU "
            "tier may evict them meanwhile: counted lost), its overflow dropped and counted "
            "as backpressure")
    probe_unknown: bool = option(
        True, boolean(),
        doc="the medium may be shared (DP replicas, restarted engines, NFS, one bucket): a "
            "key this engine's index does not know is looked for there by a tier worker, the "
            "lookup answering RETRY until it knows; false: the medium is this engine's alone, "
            "such a key is a MISS at once")
    probe_ttl_s: float = option(
        0.25, number(0, 3600, min_open=True),
        doc="a key found absent answers MISS without a new look until no lookup asked for "
            "it for this long")
    probe_timeout_s: float = option(
        2.0, number(0, 3600, min_open=True),
        doc="a look not answered by then (a hung filesystem or object store) answers MISS")
    mac_key_file: Secret | None = option(
        None, secret_file(*MAC_KEY_BYTES).or_none(),
        doc="authenticate every chunk with a keyed BLAKE2b tag, for a medium others can "
            "write: a file only its owner can read (openssl rand -hex 32 > key), read when "
            "the spec is built; a chunk without a valid tag is a MISS, and engines share "
            "chunks only with the same key",
        default_doc="none (off)")
    mac_key: Secret | None = option(
        None, secret_hex(*MAC_KEY_BYTES, source="mac_key").or_none(),
        doc="the same secret as hex digits in the config itself (configs get logged: prefer "
            "mac_key_file; never shown by shmtier); at most one of the two",
        default_doc="none (off)")

    @property
    def mac_secret(self) -> bytes | None:
        """The MAC key's bytes (from ``mac_key_file`` or ``mac_key``), or None."""
        secret = self.mac_key_file or self.mac_key
        return secret.value if secret is not None else None

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
