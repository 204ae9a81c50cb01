"""``fs`` tier options (any process): what ``secondary_tiers[i]`` of type ``fs`` accepts.

Checked when the spec is built, so a missing, non-directory or read-only
``root_dir``, a string for a boolean or a ``max_bytes`` too small for one chunk
fails there, naming the key, before any tier worker starts; and so do two fs tiers of
one engine on one root (``check_shared_roots``: the engine's config calls it with all
its tiers).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shmtier.options import ConfigError, boolean, integer, one_of, writable_dir
from shmtier.storage.config import StorageTierConfig
from shmtier.tiers.config import REQUIRED, option

#: O_DIRECT writes a tier worker keeps in flight at most (``write_depth``).
MAX_WRITE_DEPTH = 64
#: O_DIRECT reads a tier worker keeps in flight (``direct_reads.py``; the job loop's load
#: slices hold 8 keys)
READ_DEPTH = 8
#: what ``direct_io`` accepts (the first: the default)
DIRECT_IO_VALUES = ("adaptive", False, True, "auto", "writes")


@dataclass(frozen=True, kw_only=True)
class FsTierConfig(StorageTierConfig):
    """An ``fs`` tier: chunks as framed, checksummed files under ``root_dir``, in a
    namespace subdirectory per layout (engines of one layout may share it: DP replicas,
    restarts, NFS), with the options every storage tier takes (``StorageTierConfig``).
    Measurements behind ``direct_io`` and ``page_cache_bytes``: bench/README.md."""

    frame_word = "file"

    root_dir: str = option(
        REQUIRED, writable_dir(),
        doc="the directory the tier keeps its files in, checked when the spec is built; a "
            "subdirectory per layout (model, dtype, geometry), so engines of different "
            "models never mix")
    min_free_bytes: int | None = option(
        1 << 30, integer(0).or_none("null (no floor)"),
        doc="free space the tier workers keep on the filesystem; below it the tier evicts its "
            "least recently used chunks, or fails cascades (one warning) when that cannot "
            "help", default_doc="`1073741824` (1 GiB)")
    fsync: bool = option(
        False, boolean(),
        doc="fsync each file before publishing it (durable before it is indexed: NFS)")
    direct_io: bool | str = option(
        "adaptive", one_of(*DIRECT_IO_VALUES),
        doc="\"adaptive\": a load reads a chunk from the page cache when it is all there, "
            "else with O_DIRECT (a read adds no page cache; buffered where the kernel lacks "
            "cachestat, Linux < 6.5), and stores are buffered "
            "(page_cache_bytes) until, with page_cache_bytes \"auto\", a tier worker's "
            "buffered writes prove new page cache expensive: its stores are O_DIRECT from "
            "then on (logged, and the gauge direct_stores); where the filesystem does not "
            "take O_DIRECT (probed at start), as false. false: buffered both ways; "
            "\"writes\": stores with O_DIRECT where the filesystem takes it, loads "
            "buffered; \"auto\": O_DIRECT both ways where the filesystem takes it; true: "
            "both ways, required. O_DIRECT stores keep write_depth writes in flight per tier "
            f"worker, O_DIRECT loads {READ_DEPTH} reads: no page-cache copy, but every one "
            "waits for the device. Buffered is faster where recent chunks are promoted from "
            "the page cache; on a run that cascades many GiB O_DIRECT cost the tier workers "
            "a quarter less CPU and promoted sooner (bench/README.md, \"Cost per byte over "
            "a long run\" and its \"direct_io: adaptive, the new default\")")
    write_depth: int = option(
        8, integer(1, MAX_WRITE_DEPTH),
        doc="O_DIRECT writes a tier worker keeps in flight, each on an I/O thread with a "
            "chunk-sized buffer; a store slice holds at least this many chunks (unused with "
            "buffered I/O)")
    page_cache_bytes: int | str | None = option(
        "auto", integer(1).or_none("null (no limit)").or_text(
            "auto", "bounded once new page cache proves expensive"),
        doc="with buffered stores, the bytes of a tier worker's most recent files left in "
            "the page cache, older ones written back and dropped from it (null: the "
            "kernel's choice; \"auto\": no limit while new page cache is cheap; once 32 MiB "
            "of a worker's buffered writes cost more than 2.5 s of CPU per GiB, the footprint "
            "stops growing at what it then holds, at least 64 MiB: logged, and the gauge "
            "page_cache_bounded; with direct_io \"adaptive\", where the filesystem takes "
            "O_DIRECT, the stores turn O_DIRECT instead). Linux only")
    n_read_threads: int | None = option(
        None, integer(1).or_none(),
        doc="vLLM's fs option: accepted and unused (the tier workers do the I/O)")
    n_write_threads: int | None = option(
        None, integer(1).or_none(),
        doc="vLLM's fs option: accepted and unused (the tier workers do the I/O)")

    @classmethod
    def check_engine_tiers(cls, tiers: Iterable[Any]) -> None:
        """One engine's checked ``secondary_tiers`` together (each was checked alone):
        no two fs tiers share a namespace (:func:`check_shared_roots`)."""
        check_shared_roots(tiers)


def check_shared_roots(tiers: Iterable[Any]) -> None:
    """Refuse two fs tiers of one engine that would share one namespace directory: the
    same ``root_dir`` (the same directory, by whatever path or link) and the same MAC
    key, or none (the namespace is the layout's fingerprint and the key's id).

    ``tiers``: the engine's checked ``secondary_tiers`` entries (objects with ``where``,
    e.g. "secondary_tiers[1]", and ``options``, the tier's config; those whose options
    are no ``FsTierConfig`` are skipped). Called when the spec is built, after each
    tier's own checks; a few ``stat`` calls. Raises ConfigError naming both tiers.

    Why refuse: the two tiers would index the same files, each counting them against its
    own ``max_bytes`` (the disk holds less than either tier counts; its bytes gauge
    twice what is there), each evicting chunks the other indexes (a chunk the upper
    tier evicts is gone from the lower one too: its lookups HIT, its loads MISS), and
    each cascade to the lower tier finds the chunk there already: it adds no capacity.
    Different directories (even on one filesystem) or different MAC keys are fine."""
    seen: dict[tuple, tuple[str, str]] = {}
    for tier in tiers:
        config = getattr(tier, "options", None)
        if not isinstance(config, FsTierConfig):
            continue
        try:
            st = os.stat(config.root_dir)
            where_on_disk: tuple = (st.st_dev, st.st_ino)
        except OSError:  # checked a moment ago: gone since, compare by path
            where_on_disk = (os.path.realpath(config.root_dir),)
        namespace = (where_on_disk, config.mac_secret)
        other = seen.get(namespace)
        if other is not None:
            same = "" if other[1] == config.root_dir else f" ({other[1]!r})"
            raise ConfigError(
                f"{tier.where}.root_dir = {config.root_dir!r} is invalid: "
                f"{other[0]}.root_dir{same} is the same directory, and with "
                f"{'the same MAC key' if config.mac_secret is not None else 'no MAC key'} "
                f"both fs tiers would share one namespace (each counting the other's files "
                f"against its max_bytes and evicting the other's chunks); expected a "
                f"directory of its own for each fs tier of an engine")
        seen[namespace] = (tier.where, config.root_dir)
