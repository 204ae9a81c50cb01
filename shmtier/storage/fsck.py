"""What ``shmtier fsck`` shares between the storage tiers (``fs``, ``obj``): the kinds of
problem, the report, and the check of one stored frame.

Who uses it: ``shmtier/tiers/fs/fsck.py`` (an fs tier root) and
``shmtier/tiers/obj/fsck.py`` (an obj tier bucket), run by the ``shmtier`` CLI in a
process of its own. A frame is judged by the codec that tier workers use
(``shmtier.shared.codec``: ``parse_frame_header`` for the cheap check, a whole
``ChunkDecoder.decode_into`` with ``--verify``), so fsck calls bad exactly what a load
would refuse. Pure CPU; never blocks.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field

from shmtier.shared.codec import (
    ChunkDecoder,
    CorruptChunkError,
    FrameHeader,
    frame_header_size,
    mac_key_id,
    parse_frame_header,
)
from shmtier.storage.chunk_names import MAC_MARK

#: Every kind of problem fsck reports, and what it means.
KINDS = {
    "corrupt": "a chunk whose frame fails a check (header, key, CRC, MAC): a load refuses it",
    "truncated": "a chunk shorter than its frame (a torn or cut write)",
    "oversized": "a chunk longer than its frame (bytes appended), or a file at a chunk's name "
                 "larger than any chunk of its namespace's layout could be (not ours: the tier "
                 "removes it as a miss)",
    "wrong_size": "a chunk whose frame holds another chunk size than its namespace's layout "
                  "(e.g. copied from another namespace): a load refuses it",
    "foreign": "an entry in a namespace directory that is none of the tier's names",
    "orphan_temp": "a temp file whose writer is dead (or older than the stale age)",
    "misplaced": "a chunk in a fan-out directory its key does not map to (never loaded)",
    "link": "a symbolic link where the layout has a file or directory (never followed)",
    "bad_namespace": "a namespace without a valid config.json (left alone)",
    "unreadable": "a directory or file that could not be read",
}
#: Raw bytes a chunk may decode to under ``--verify`` (a header claiming more is corrupt).
MAX_RAW_BYTES = 1 << 30
EXIT_CLEAN, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


#: The block geometry at the end of a layout fingerprint (``PrimaryConfig.fingerprint`` in
#: shmtier/config.py; a namespace's fingerprint is that, plus ``MAC_MARK`` and a key id).
_GEOMETRY = re.compile(r"\bblock=\d+x(\d+) bytes_per_block=(\d+) world=(\d+) "
                       r"replicated=([01])$")


def layout_chunk_bytes(fingerprint: str) -> int | None:
    """The bytes of one chunk (a frame's raw length) in the namespace of ``fingerprint``:
    KV bytes per block x blocks per chunk x copies (the world size, or 1 when the layout
    is replicated), as the spec sizes a chunk; None for a fingerprint that does not end in
    the block geometry (not written by a shmtier engine): its chunk size is not checked."""
    layout, mark, _ = fingerprint.rpartition(MAC_MARK)
    m = _GEOMETRY.search(layout if mark else fingerprint)
    if m is None:
        return None
    blocks, per_block, world, replicated = (int(g) for g in m.groups())
    return per_block * blocks * (1 if replicated else world)


class FsckError(Exception):
    """The target cannot be checked at all (no such root, bucket unreachable): exit 2."""


@dataclass
class Problem:
    """One thing found wrong: its ``kind`` (``KINDS``), where (a path relative to the root,
    or an object key), why, its size in bytes when known, whether ``--repair`` may remove
    it, and whether it was removed."""

    kind: str
    path: str
    detail: str = ""
    size: int = 0
    removable: bool = True
    repaired: bool = False


@dataclass
class NamespaceReport:
    """One namespace: its directory (or key prefix) name, fingerprint, its chunk size
    (``layout_chunk_bytes``), the good chunks and their bytes, temp files of live writers left alone, whether it carries MAC tags
    and whether they were checked (only with its key)."""

    name: str
    fingerprint: str = ""
    chunk_bytes: int | None = None  # from the fingerprint (None: not known, not checked)
    chunks: int = 0
    bytes: int = 0
    temp_live: int = 0
    mac: bool = False
    mac_checked: bool = True


@dataclass
class FsckReport:
    """What one fsck run found. ``other_entries``: entries beside the namespaces (another
    program's files, e.g. vLLM's own fs tier): not looked into, never touched."""

    tier: str
    target: str
    verify: bool
    repair: bool
    namespaces: list[NamespaceReport] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    other_entries: int = 0
    seconds: float = 0.0
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def add(self, kind: str, path: str, detail: str = "", size: int = 0, *,
            removable: bool = True) -> Problem:
        problem = Problem(kind, path, detail, size, removable)
        self.problems.append(problem)
        return problem

    def done(self) -> "FsckReport":
        self.seconds = time.monotonic() - self._t0
        return self

    @property
    def unrepaired(self) -> list[Problem]:
        return [p for p in self.problems if not p.repaired]

    @property
    def exit_code(self) -> int:
        """0 when nothing is wrong (now: every problem found was repaired), else 1."""
        return EXIT_PROBLEMS if self.unrepaired else EXIT_CLEAN

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.problems:
            out[p.kind] = out.get(p.kind, 0) + 1
        return out

    def as_dict(self) -> dict:
        return {
            "tier": self.tier, "target": self.target, "verify": self.verify,
            "repair": self.repair, "seconds": round(self.seconds, 3),
            "namespaces": [asdict(n) for n in self.namespaces],
            "chunks": sum(n.chunks for n in self.namespaces),
            "bytes": sum(n.bytes for n in self.namespaces),
            "problems": [asdict(p) for p in self.problems],
            "counts": self.counts(),
            "repaired": sum(p.repaired for p in self.problems),
            "other_entries": self.other_entries,
            "exit_code": self.exit_code,
        }

    def text(self, limit: int = 50) -> str:
        """The report in words: one line per namespace, one per problem (the first
        ``limit``), then the totals."""
        lines = [f"{self.tier} {self.target}: {len(self.namespaces)} namespace(s)"
                 + (", verified (decode + CRC)" if self.verify else ", headers checked")]
        for n in self.namespaces:
            mac = "" if not n.mac else (" MAC checked" if n.mac_checked
                                        else " MAC tags not checked (no key)")
            live = f", {n.temp_live} temp file(s) of live writers" if n.temp_live else ""
            size = (f", chunk size {n.chunk_bytes}" if n.chunk_bytes is not None
                    else ", chunk size unknown (not checked)")
            lines.append(f"  {n.name}: {n.chunks} chunks, {n.bytes} bytes{size}{live}{mac}")
        for p in self.problems[:limit]:
            state = "removed" if p.repaired else ("" if p.removable else "left alone")
            lines.append(f"  {p.kind:13s} {p.path}" + (f"  ({p.detail})" if p.detail else "")
                         + (f"  [{state}]" if state else ""))
        if len(self.problems) > limit:
            lines.append(f"  ... and {len(self.problems) - limit} more (--json lists all)")
        if self.other_entries:
            lines.append(f"  {self.other_entries} other entr{'y' if self.other_entries == 1 else 'ies'}"
                         f" beside the namespaces (not ours: untouched)")
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts().items())) or "none"
        repaired = sum(p.repaired for p in self.problems)
        lines.append(f"problems: {counts}" + (f"; removed {repaired}" if self.repair else "")
                     + f" ({self.seconds:.2f} s)")
        return "\n".join(lines)


class FrameCheck:
    """Judges the stored frames of one namespace (``mac_id``: the MAC key id its
    fingerprint names, or None) as a load would: a frame of a MAC'd namespace must carry
    a tag, one of another namespace must not. The tag itself is verified only with
    ``mac_key`` of that id (``mac_checked``); without it, everything else is. With
    ``chunk_bytes`` (``layout_chunk_bytes``), a frame of another raw length is
    ``wrong_size``."""

    def __init__(self, mac_id: str | None, mac_key: bytes | None = None,
                 chunk_bytes: int | None = None):
        self.chunk_bytes = chunk_bytes
        self.need_tag = mac_id is not None
        has_key = mac_key is not None and mac_id is not None and mac_key_id(mac_key) == mac_id
        self.mac_checked = mac_id is None or has_key
        self.decoder = (ChunkDecoder(mac_key=mac_key) if has_key
                        else ChunkDecoder(ignore_mac=self.need_tag))
        self._out = bytearray()

    @staticmethod
    def head_bytes(key_len: int) -> int:
        """Bytes to read for :meth:`check_header` (a header with a tag, at most)."""
        return frame_header_size(key_len, mac=True)

    def check_header(self, head, key: bytes, size: int) -> tuple[str, str] | FrameHeader:
        """The problem (kind, detail) with the frame of ``key`` whose first bytes are
        ``head`` and whose stored size is ``size``, or its header when there is none."""
        try:
            h = parse_frame_header(memoryview(head))
        except CorruptChunkError as e:
            return ("truncated" if e.reason == "length" else "corrupt"), _why(e)
        if h.key != key:
            return "corrupt", f"key: the frame holds key {h.key.hex()[:16]}..."
        if bool(h.tag) != self.need_tag:
            return "corrupt", ("mac: a tagged frame in a namespace without a MAC key" if h.tag
                               else "mac: a frame without a tag in a MAC'd namespace")
        if size != h.frame_size:
            return ("truncated" if size < h.frame_size else "oversized",
                    f"length: {size} bytes, the frame has {h.frame_size}")
        if h.raw_len > MAX_RAW_BYTES:
            return "corrupt", f"length: raw length {h.raw_len} exceeds {MAX_RAW_BYTES}"
        if self.chunk_bytes is not None and h.raw_len != self.chunk_bytes:
            return "wrong_size", (f"chunk size: the frame holds {h.raw_len} bytes, the "
                                  f"namespace's layout {self.chunk_bytes}")
        return h

    def check_frame(self, frame, key: bytes, header: FrameHeader) -> tuple[str, str] | None:
        """Decode the whole ``frame`` (``--verify``): every CRC, the zstd content checksum
        and, with the key, the MAC; the problem (kind, detail) or None."""
        if len(self._out) < header.raw_len:
            self._out = bytearray(header.raw_len)
        try:
            self.decoder.decode_into(memoryview(frame), key,
                                     memoryview(self._out)[:header.raw_len])
        except CorruptChunkError as e:
            return ("truncated" if e.reason == "length" else "corrupt"), _why(e)
        return None


def _why(e: CorruptChunkError) -> str:
    reason = getattr(e, "reason", "") or "codec"
    detail = getattr(e, "detail", "")
    return f"{reason}: {detail}"[:200] if detail else reason
