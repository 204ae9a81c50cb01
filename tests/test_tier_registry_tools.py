"""A tier type brings its own fsck, ``top`` status and backpressure profile through its
registry entry (``shmtier/tiers/registry.py``): an out-of-tree tier registered here, from
this test module, gets ``shmtier fsck``/``clean``, ``shmtier top`` and its backpressure
defaults without a line of ``shmtier/cli.py``, ``shmtier/top.py`` or the backpressure
validation naming it; unregistered, it has none of them. The built-in types keep theirs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

from shmtier.cli import main
from shmtier.config import TieringConfig
from shmtier.scheduler.backpressure import build_detector
from shmtier.scheduler.backpressure.validation import (
    LOCAL_HIGH_WATER_S,
    NETWORK_HIGH_WATER_S,
    NETWORK_LOW_WATER_S,
)
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.segment import open_segment
from shmtier.tiers import registry
from shmtier.tiers.commands import TierFsck, TierStatus
from shmtier.storage.fsck import FsckReport, NamespaceReport
from shmtier.top import run_top

NAME = "scratch"


class ScratchFsck(TierFsck):
    """Checks a directory of ``*.chunk`` files: a file with ``bad`` in it is corrupt;
    ``clean --scratch-dir`` removes ``*.tmp`` files."""

    target = "a scratch tier directory"
    usage = "--scratch-dir for a scratch tier directory"
    clean_what = "with --scratch-dir, scratch temp files"

    def add_arguments(self, parser) -> None:
        parser.add_argument("--scratch-dir", metavar="DIR")

    def chosen(self, args) -> bool:
        return bool(args.scratch_dir)

    def run(self, args, mac_key):
        report = FsckReport(self.tier_type, args.scratch_dir, args.verify, args.repair)
        ns = NamespaceReport("all")
        report.namespaces.append(ns)
        for name in sorted(os.listdir(args.scratch_dir)):
            path = os.path.join(args.scratch_dir, name)
            with open(path, "rb") as f:
                data = f.read()
            if b"bad" in data:
                problem = report.add("corrupt", name, "holds 'bad'", len(data))
                if args.repair:
                    os.unlink(path)
                    problem.repaired = True
            else:
                ns.chunks += 1
                ns.bytes += len(data)
        return report.done()

    def add_clean_arguments(self, parser) -> None:
        parser.add_argument("--scratch-dir", action="append", default=[], metavar="DIR")

    def clean(self, args):
        lines = []
        for d in args.scratch_dir:
            for name in sorted(os.listdir(d)):
                if name.endswith(".tmp"):
                    os.unlink(os.path.join(d, name))
                    lines.append(f"removed {d}/{name}")
        return lines, 0


class ScratchStatus(TierStatus):
    def sessions(self, engine_id: str) -> list[dict]:
        return [{"engine_id": engine_id, "mirrors": 2}]

    def lines(self, session: dict) -> list[str]:
        return [f"scratch  {session['engine_id']} mirrored {session['mirrors']}x"]


@pytest.fixture
def scratch_tier():
    """The scratch tier, registered for the test (the example tier's scheduler half and
    config: only the tools and the profile matter here), unregistered after it."""
    registry.register(registry.TierType(
        NAME, "shmtier.tiers.example.scheduler:ExampleSecondaryTierManager",
        config="shmtier.tiers.example.config:ExampleTierConfig",
        fsck=f"{__name__}:ScratchFsck", status=f"{__name__}:ScratchStatus",
        backpressure=registry.BackpressureProfile(network=True, failures_are_pressure=True)))
    try:
        yield
    finally:
        registry.unregister(NAME)


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_a_registered_tier_gets_fsck_and_clean(scratch_tier, tmp_path):
    (tmp_path / "a.chunk").write_bytes(b"good bytes")
    (tmp_path / "b.chunk").write_bytes(b"bad bytes")
    code, out, _ = cli("fsck", "--scratch-dir", str(tmp_path), "--json")
    report = json.loads(out)
    assert code == 1 and report["exit_code"] == 1
    assert (report["tier"], report["chunks"], report["bytes"]) == (NAME, 1, 10)
    assert [(p["kind"], p["path"]) for p in report["problems"]] == [("corrupt", "b.chunk")]
    code, out, _ = cli("fsck", "--scratch-dir", str(tmp_path), "--repair")
    assert code == 0 and "corrupt       b.chunk  (holds 'bad')  [removed]" in out
    assert sorted(os.listdir(tmp_path)) == ["a.chunk"]

    # its usage sits beside the built-in tiers' in the help and in the usage error
    help_text = subprocess_free_help("fsck")
    assert "a scratch tier directory" in help_text and "an fs tier root" in help_text
    code, _, err = cli("fsck")
    assert code == 2 and "--scratch-dir for a scratch tier directory" in err
    assert "an fs tier ROOT" in err
    code, _, err = cli("fsck", "--scratch-dir", str(tmp_path), str(tmp_path))
    assert code == 2 and "(one of them)" in err  # two tiers' targets named

    (tmp_path / "c.tmp").write_bytes(b"")
    code, out, _ = cli("clean", "no-such-engine", "--scratch-dir", str(tmp_path))
    assert code == 0 and out.strip() == f"removed {tmp_path}/c.tmp"
    assert sorted(os.listdir(tmp_path)) == ["a.chunk"]


def subprocess_free_help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    return re.sub(r"\s+", " ", out.getvalue())


def test_an_unregistered_tier_has_no_fsck(tmp_path):
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            main(["fsck", "--scratch-dir", str(tmp_path)])  # no such argument
    assert "scratch" not in subprocess_free_help("fsck")


def test_a_registered_tier_shows_its_status_in_top(scratch_tier, engine_id):
    seg = open_segment(engine_id, ArenaGeometry(4, 4096, 4096, 1), "fp", owner=True)
    try:
        out = io.StringIO()
        assert run_top(engine_id, once=True, as_json=True, interval=0.01, out=out) == 0
        frame = json.loads(out.getvalue())
        assert frame[NAME] == [{"engine_id": engine_id, "mirrors": 2}]
        assert frame["p2p"] == []  # the built-in p2p tier's status: no endpoint here
        out = io.StringIO()
        assert run_top(engine_id, once=True, as_json=False, interval=0.01, out=out) == 0
        assert f"scratch  {engine_id} mirrored 2x" in out.getvalue().splitlines()
    finally:
        seg.close()
    # the CLI in a process of its own has only the built-in tiers' statuses
    seg = open_segment(engine_id, ArenaGeometry(4, 4096, 4096, 1), "fp", owner=True)
    try:
        got = subprocess.run([sys.executable, "-m", "shmtier", "top", engine_id, "--once",
                              "--json", "--interval", "0.01"], capture_output=True,
                             text=True, timeout=60)
        assert got.returncode == 0, got.stderr
        frame = json.loads(got.stdout)
        assert "p2p" in frame and NAME not in frame
    finally:
        seg.close()


def _detector(tier_type: str, **options):
    entry = {"type": tier_type, "backpressure": {}, **options}
    config = TieringConfig.from_extra_config({"secondary_tiers": [entry]})
    return build_detector(config.secondary_tiers[0].backpressure)


def test_a_registered_tier_gets_its_backpressure_profile(scratch_tier, tmp_path):
    det = _detector(NAME)
    assert (det.high_water_s, det.low_water_s, det.failure_threshold) == (
        NETWORK_HIGH_WATER_S, NETWORK_LOW_WATER_S, 3)
    # the built-in types keep theirs: fs local with failures, example neither
    fs = _detector("fs", root_dir=str(tmp_path))
    assert (fs.high_water_s, fs.failure_threshold) == (LOCAL_HIGH_WATER_S, 3)
    example = _detector("example")
    assert (example.high_water_s, example.failure_threshold) == (LOCAL_HIGH_WATER_S, None)


def test_without_a_profile_a_tier_gets_the_default(scratch_tier):
    registry.unregister(NAME)
    registry.register(registry.TierType(
        NAME, "shmtier.tiers.example.scheduler:ExampleSecondaryTierManager",
        config="shmtier.tiers.example.config:ExampleTierConfig"))
    det = _detector(NAME)
    assert (det.high_water_s, det.failure_threshold) == (LOCAL_HIGH_WATER_S, None)


def test_built_in_types_cannot_be_unregistered():
    for name in ("fs", "nonexistent"):
        with pytest.raises(ValueError, match="not a registered out-of-tree tier type"):
            registry.unregister(name)
    assert "fs" in registry.names()


def test_no_module_outside_the_tiers_decides_by_a_tier_type_name():
    """The registry names tier types; code elsewhere asks it (docs/architecture.md)."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "shmtier")
    offenders = []
    for dirpath, _, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == "tiers" or rel.startswith("tiers" + os.sep):
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                for n, line in enumerate(f, 1):
                    if re.search(r"""(==|!=|\bin)\s*[\(\[{]?\s*["'](fs|obj|p2p|node)["']|"""
                                 r"""[\[{]\s*["'](fs|obj|p2p|node)["']\s*[\]},]|"""
                                 r"""import\s.*shmtier\.tiers\.(fs|obj|p2p|node)\b|"""
                                 r"""from shmtier\.tiers\.(fs|obj|p2p|node)\b""", line):
                        offenders.append(f"{os.path.relpath(path, root)}:{n}: {line.strip()}")
    # the stress run and the bench are fs-tier harnesses by design: they run that tier
    allowed = ("stress" + os.sep, "bench" + os.sep)
    assert [o for o in offenders if not o.startswith(allowed)] == []
