"""The fs tier's part of the ``shmtier`` command: ``shmtier fsck ROOT`` and
``shmtier clean --root DIR`` (:class:`FsFsck`, named in the tier registry).

Runs in: the ``shmtier`` CLI's process. Importing it is cheap; ``run`` and ``clean`` walk
the root with ``shmtier/tiers/fs/fsck.py`` (blocks on the filesystem).
"""

from __future__ import annotations

import sys

from shmtier.tiers.commands import TierFsck


class FsFsck(TierFsck):
    target = "an fs tier root"
    usage = "an fs tier ROOT"
    clean_what = "with --root, orphaned fs temp files"

    def add_arguments(self, parser) -> None:
        parser.add_argument("root", nargs="?", metavar="ROOT", help="fs tier root_dir")
        parser.add_argument("--stale-temp-age", type=float, default=None, metavar="SECONDS",
                            help="temp files older than this are orphaned whoever wrote them "
                            "(default: the fs tier's, 900)")

    def chosen(self, args) -> bool:
        return bool(args.root)

    def run(self, args, mac_key: bytes | None):
        from shmtier.tiers.fs.fsck import fsck_root

        kw = {} if args.stale_temp_age is None else {"stale_temp_age_s": args.stale_temp_age}
        return fsck_root(args.root, verify=args.verify, repair=args.repair, mac_key=mac_key,
                         **kw)

    def add_clean_arguments(self, parser) -> None:
        parser.add_argument("--root", action="append", default=[], metavar="DIR",
                            help="an fs tier root_dir whose orphaned temp files to remove "
                            "(repeatable)")

    def clean(self, args) -> tuple[list[str], int]:
        """Remove the temp files of dead writers under each ``--root``."""
        from shmtier.tiers.fs.fsck import fsck_root
        from shmtier.storage.fsck import FsckError

        lines, code = [], 0
        for root in args.root:
            try:
                report = fsck_root(root, repair={"orphan_temp"})
            except FsckError as e:
                print(f"shmtier clean: {e}", file=sys.stderr)
                code = 2
                continue
            lines += [f"removed {report.target}/{p.path}" for p in report.problems
                      if p.kind == "orphan_temp" and p.repaired]
        return lines, code
