"""Every tier option is checked when the spec is built (in the calling process, before
any segment, worker or file exists), and the error names the key, the value and what
is accepted. One table per tier type, from the tier registry."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from shmtier.config import ConfigError, KVLayout, TieringConfig, max_tier_workers
from shmtier.spec import TieringOffloadingSpec
from shmtier.tiers import registry

LAYOUT = KVLayout("m", "bfloat16", 16, 8192, 1)


def build(tier: dict, **extra):
    """Build a spec (no manager: nothing is created) with one secondary tier."""
    return TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier], **extra},
                                 LAYOUT, "never-created")


def no_segment_made():
    return not [n for n in os.listdir("/dev/shm") if "never-created" in n]


FS_INVALID = [
    ({"root_dir": "/nonexistent/dir"}, r"secondary_tiers\[0\]\.root_dir = '/nonexistent/dir' is "
                                       r"invalid: expected an existing, writable directory "
                                       r"\(/nonexistent/dir does not exist"),
    ({"root_dir": "FILE"}, r"\.root_dir = '.*a_file' is invalid: .* is not a directory"),
    ({"root_dir": 42}, r"\.root_dir = 42 is invalid: expected an existing, writable directory"),
    ({}, r"secondary_tiers\[0\]\.root_dir is required \(an existing, writable directory\)"),
    ({"fsync": "no"}, r"\.fsync = 'no' is invalid: expected true or false"),
    ({"fsync": 1}, r"\.fsync = 1 is invalid: expected true or false"),
    ({"enable_kv_events": "yes"}, r"\.enable_kv_events = 'yes' is invalid: expected true or false"),
    ({"max_bytes": 0}, r"\.max_bytes = 0 is invalid: expected an integer >= 1, or null"),
    ({"max_bytes": "1G"}, r"\.max_bytes = '1G' is invalid"),
    ({"max_bytes": 8000}, r"\.max_bytes = 8000 is invalid: expected at least one chunk's file "
                          r"\(8272 bytes"),
    ({"min_free_bytes": -1}, r"\.min_free_bytes = -1 is invalid: expected an integer >= 0, or null"),
    ({"direct_io": "yes"}, r"\.direct_io = 'yes' is invalid: expected one of false, true, 'auto'"),
    ({"direct_io": 1}, r"\.direct_io = 1 is invalid"),
    ({"locality": "NEAR"}, r"\.locality = 'NEAR' is invalid: expected 'LOCAL' or 'REMOTE'"),
    ({"max_pinned_fraction": 0}, r"\.max_pinned_fraction = 0 is invalid: expected a number > 0 and <= 1"),
    ({"max_pinned_fraction": 1.5}, r"\.max_pinned_fraction = 1.5 is invalid"),
    ({"n_read_threads": 0}, r"\.n_read_threads = 0 is invalid"),
    ({"root_dir_": "/tmp"}, r"secondary_tiers\[0\] has unknown key\(s\) 'root_dir_' "
                            r"\(did you mean 'root_dir'\?\)"),
    ({"backpressure": {"alpha": 2}}, r"secondary_tiers\[0\]\.backpressure.*alpha.*2"),
]


@pytest.mark.parametrize("options, message", FS_INVALID)
def test_fs_options_fail_when_the_spec_is_built(tmp_path, options, message):
    (tmp_path / "a_file").write_text("x")
    tier = {"type": "fs", "root_dir": str(tmp_path), **options}
    if tier["root_dir"] == "FILE":
        tier["root_dir"] = str(tmp_path / "a_file")
    if not options:
        del tier["root_dir"]
    with pytest.raises(ConfigError, match=message):
        build(tier)
    assert no_segment_made()
    assert not [p for p in tmp_path.iterdir() if p.name != "a_file"]  # nothing written


def test_example_options_fail_when_the_spec_is_built():
    with pytest.raises(ConfigError, match=r"\.custom_param = 'x' is invalid: expected an integer"):
        build({"type": "example", "custom_param": "x"})
    with pytest.raises(ConfigError, match=r"has unknown key\(s\) 'locality'; accepted keys: "
                                          r"\['custom_param'\]"):
        build({"type": "example", "locality": "LOCAL"})


def test_every_built_in_tier_type_has_a_config_table_here():
    assert {t.name for t in registry.BUILT_IN} == {"fs", "example"}, \
        "a new tier type needs its invalid-option cases in this file"


def test_valid_fs_options_are_normalised_and_reach_the_workers(tmp_path):
    spec = build({"type": "fs", "root_dir": str(tmp_path), "locality": "remote",
                  "max_bytes": 1 << 20, "fsync": True})
    (tier,) = spec.tiering_config.secondary_tiers
    assert tier.options.locality == "REMOTE"
    assert spec.pool_config.tiers == [{"type": "fs", "args": {
        "root_dir": str(tmp_path), "max_bytes": 1 << 20, "min_free_bytes": 1 << 30,
        "fsync": True, "direct_io": False}}]
    with pytest.raises(AttributeError):
        tier.options.fsync = False  # frozen


def test_config_is_data_built_in_any_process(tmp_path):
    """Parsing builds no detector: the tier config holds settings, equal for equal input."""
    extra = {"secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "backpressure": {}}]}
    a, b = TieringConfig.from_extra_config(extra), TieringConfig.from_extra_config(extra)
    assert a == b
    assert a.secondary_tiers[0].backpressure is not None


def _unwritable_dir_command(path: str) -> list[str] | None:
    """A command prefix under which ``path`` is a read-only directory, or None."""
    if os.geteuid() != 0:
        os.chmod(path, 0o500)
        return []
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro,size=1m none "{path}" && exec "$@"',
            "sh"]


def test_an_unwritable_root_dir_fails_when_the_spec_is_built(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    prefix = _unwritable_dir_command(str(root))
    if prefix is None:
        pytest.skip("cannot make a read-only directory here (root without unshare/mount)")
    code = textwrap.dedent(f"""
        from shmtier.config import ConfigError, KVLayout
        from shmtier.spec import TieringOffloadingSpec
        try:
            TieringOffloadingSpec({{"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [
                {{"type": "fs", "root_dir": {str(root)!r}}}]}},
                KVLayout("m", "bfloat16", 16, 8192, 1), "never-created")
        except ConfigError as e:
            print(e)
        else:
            print("built")
    """)
    try:
        out = subprocess.run(prefix + [sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=60)
    finally:
        os.chmod(root, 0o700)
    assert out.returncode == 0, out.stderr
    assert f"secondary_tiers[0].root_dir = {str(root)!r} is invalid" in out.stdout
    assert "is not writable: EROFS" in out.stdout or "is not writable: EACCES" in out.stdout


def test_num_tier_workers_is_bounded_by_cores_and_memory():
    limit, why = max_tier_workers()
    assert 1 <= limit <= 4 * (os.cpu_count() or 1)
    with pytest.raises(ConfigError, match=rf"\['num_tier_workers'\] = 1000 is invalid: expected "
                                          rf"an integer in 1\.\.{limit} on this host \(4 per core x "
                                          rf"\d+ cores = \d+; \d+ MiB of memory available"):
        TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20, "num_tier_workers": 1000}, LAYOUT, "x")
    TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20, "num_tier_workers": limit}, LAYOUT, "x")


def test_top_level_keys_are_checked():
    for extra, message in [
        ({"tier_job_timeout_s": 0}, r"\['tier_job_timeout_s'\] = 0 is invalid: expected a number > 0"),
        ({"tier_poll_interval_s": "1ms"}, r"\['tier_poll_interval_s'\] = '1ms' is invalid"),
        ({"secondary_tiers": {"type": "fs"}}, r"secondary_tiers must be a list of tier configurations"),
        ({"secondary_tiers": ["fs"]}, r"secondary_tiers\[0\] = 'fs' is invalid: expected a dict"),
    ]:
        with pytest.raises(ConfigError, match=message):
            TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20, **extra}, LAYOUT, "x")
