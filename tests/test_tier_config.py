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
    ({"direct_io": "yes"}, r"\.direct_io = 'yes' is invalid: expected one of 'adaptive', false, "
                           r"true, 'auto', 'writes'"),
    ({"write_depth": 0}, r"\.write_depth = 0 is invalid: expected an integer in 1\.\.64"),
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


P2P_INVALID = [
    ({"port": 70000}, r"\.port = 70000 is invalid: expected an integer in 0\.\.65535"),
    ({"unbound_store_timeout_s": 0}, r"\.unbound_store_timeout_s = 0 is invalid: expected a "
                                     r"number > 0"),
    ({"backends": ["tcp"]}, r"\.backends = \['tcp'\] is invalid: expected a non-empty list of "
                            r"'zmq' and 'UCX'"),
    ({"plaintext": "yes"}, r"\.plaintext = 'yes' is invalid: expected true or false"),
    ({"secret_key_file": None}, r"secondary_tiers\[0\]: give this engine's key pair as exactly "
                                r"one of secret_key_file"),
    ({"secret_key_file": "/nonexistent/k.key_secret"},
     r"\.secret_key_file is invalid: p2p key file /nonexistent/k\.key_secret: does not exist"),
    ({"secret_key_file": None, "secret_key": "short"},
     r"\.secret_key = <secret, not shown> is invalid"),
    ({"allow_keys_dir": None}, r"give the peers' public keys in allow_keys_dir"),
    ({"allow_keys_dir": "EMPTY"}, r"\.allow_keys_dir = '.*' is invalid: .*no \*\.key public key"),
    ({"allow_keys": "abc"}, r"\.allow_keys = 'abc' is invalid: expected a non-empty list"),
    ({"plaintext": True}, r"\.plaintext = true takes no keys"),
    ({"peers": {"nohost": "x"}}, r"\.peers = .* is invalid: .*'host:port'"),
    ({"fetch_timeout_s": -1}, r"\.fetch_timeout_s = -1 is invalid"),
]


@pytest.mark.parametrize("options, message", P2P_INVALID)
def test_p2p_options_fail_when_the_spec_is_built(tmp_path, options, message):
    pytest.importorskip("zmq")
    from shmtier.tiers.p2p.keys import generate_keypair_files

    generate_keypair_files(tmp_path / "me", "me")
    generate_keypair_files(tmp_path / "allow", "peer")
    (tmp_path / "empty").mkdir()
    tier = {"type": "p2p", "secret_key_file": str(tmp_path / "me" / "me.key_secret"),
            "allow_keys_dir": str(tmp_path / "allow"), **options}
    if tier["allow_keys_dir"] == "EMPTY":
        tier["allow_keys_dir"] = str(tmp_path / "empty")
    tier = {k: v for k, v in tier.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        build(tier)
    assert no_segment_made()


def test_p2p_plaintext_needs_no_keys_and_ucx_needs_nixl():
    pytest.importorskip("zmq")
    spec = build({"type": "p2p", "plaintext": True, "port": 0})
    assert spec.tiering_config.secondary_tiers[0].options.plaintext is True
    try:
        import nixl  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"\.backends = \['UCX'\] is invalid: .*'nixl' "
                                              r"package"):
            build({"type": "p2p", "plaintext": True, "backends": ["UCX"]})


def test_p2p_port_is_the_base_plus_the_data_parallel_index():
    """vLLM's rule: the endpoint binds ``port`` + the engine's data-parallel index (0
    stays 0: a free port); a sum past 65535 fails when the spec is built, naming both."""
    pytest.importorskip("zmq")

    def built(port, dp):
        spec = TieringOffloadingSpec(
            {"cpu_bytes_to_use": 1 << 20,
             "secondary_tiers": [{"type": "p2p", "plaintext": True, "port": port}]},
            LAYOUT, "never-created", data_parallel_index=dp)
        return spec.tiering_config.secondary_tiers[0].options.listen_port(dp)

    assert built(5710, 0) == 5710 and built(5710, 3) == 5713 and built(0, 3) == 0
    with pytest.raises(ConfigError, match=r"\.port = 65535 is invalid: this engine's "
                                          r"data-parallel index 1 is added to it and 65536"):
        built(65535, 1)
    with pytest.raises(ConfigError, match=r"data_parallel_index must be an int >= 0"):
        built(5710, -1)
    assert no_segment_made()


def test_every_built_in_tier_type_has_a_config_table_here():
    assert {t.name for t in registry.BUILT_IN} == {"fs", "example", "obj", "p2p", "node"}, \
        "a new tier type needs its invalid-option cases (obj's: test_obj_backend.py; node's: " \
        "test_node_tier.py)"


def test_every_built_in_tier_option_is_declared_with_its_description():
    """What docs/configuration.md lists for a tier type (tests/test_configuration_doc.py
    keeps it generated): every field of its config is an option with a description."""
    import dataclasses

    for tier in registry.BUILT_IN:
        for f in dataclasses.fields(tier.config_class()):
            assert "check" in f.metadata and f.metadata["doc"].strip(), \
                f"{tier.name} option {f.name!r} is not declared with option(..., doc=...)"


def test_valid_fs_options_are_normalised_and_reach_the_workers(tmp_path):
    spec = build({"type": "fs", "root_dir": str(tmp_path), "locality": "remote",
                  "max_bytes": 1 << 20, "fsync": True})
    (tier,) = spec.tiering_config.secondary_tiers
    assert tier.options.locality == "REMOTE"
    (worker_tier,) = spec.pool_config.tiers
    assert worker_tier.type == "fs" and worker_tier.options is tier.options
    assert tier.options.to_dict() == {
        "root_dir": str(tmp_path), "max_bytes": 1 << 20, "min_free_bytes": 1 << 30,
        "fsync": True, "direct_io": "adaptive", "write_depth": 8, "page_cache_bytes": "auto",
        "locality": "REMOTE", "enable_kv_events": False, "max_pinned_fraction": 0.5,
        "probe_unknown": True, "probe_ttl_s": 0.25, "probe_timeout_s": 2.0,
        "mac_key_file": None, "mac_key": None, "n_read_threads": None, "n_write_threads": None}
    with pytest.raises(AttributeError):
        tier.options.fsync = False  # frozen


def test_every_built_in_tier_config_crosses_a_process_boundary_as_plain_data(tmp_path):
    """``to_dict`` is msgpack-able and ``from_dict`` gives the same frozen config back, for
    every built-in tier type, with every secret and tuple option set (values not checked
    again on the way back: a worker must not re-read key files or ask the bucket)."""
    import dataclasses

    import msgpack

    from shmtier.options import Secret
    from shmtier.tiers.obj.config import S3StoreConfig

    secret = Secret(bytes(range(32)), "test")
    samples = {
        "fs": dict(root_dir=str(tmp_path), mac_key_file=secret, page_cache_bytes=1 << 20),
        "obj": dict(store_config=S3StoreConfig("bucket", "http://h:1", "AK",
                                               Secret(b"s" * 40, "secret_key"),
                                               Secret(b"t" * 40, "session_token")),
                    mac_key=secret),
        "p2p": dict(secret_key=secret, allow_keys=("a" * 40,), peers=(("h:1", "b" * 40),),
                    backends=("zmq",)),
        "example": dict(custom_param=3),
        "node": dict(size_bytes=1 << 20, pool="p", keep=True),
    }
    assert set(samples) == {t.name for t in registry.BUILT_IN}
    for tier in registry.BUILT_IN:
        cls = tier.config_class()
        config = cls(**samples[tier.name])
        plain = msgpack.unpackb(msgpack.packb(config.to_dict(), use_bin_type=True), raw=False)
        back = cls.from_dict(plain)
        assert back == config, tier.name
        for f in dataclasses.fields(cls):  # the same types, not lists for tuples
            assert type(getattr(back, f.name)) is type(getattr(config, f.name)), (tier.name, f)


def _through_the_segment(spec):
    """The pool config as a tier worker reads it: written as msgpack into a buffer the
    size of the segment's config area, read back (``PoolConfig.write`` / ``read``)."""
    from shmtier.shared.pool_config import CONFIG_BYTES, PoolConfig

    area = memoryview(bytearray(CONFIG_BYTES))
    spec.pool_config.write(area)
    return PoolConfig.read(area)


def test_the_tier_workers_read_back_the_frozen_configs(tmp_path):
    spec = build({"type": "fs", "root_dir": str(tmp_path), "max_bytes": 1 << 20},
                 compression={"mode": "zstd", "level": 3}, num_tier_workers=1,
                 tier_worker_policy="other")
    read = _through_the_segment(spec)
    assert read == spec.pool_config
    assert read.tiers[0].options == spec.tiering_config.secondary_tiers[0].options
    assert read.codec.level == 3 and read.options.tier_worker_policy == "other"


MAC_HEX = "00112233445566778899aabbccddeeff" * 2  # 32 bytes


def key_file(path, content, mode=0o600):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("content, expected", [
    (MAC_HEX + "\n", bytes.fromhex(MAC_HEX)),  # openssl rand -hex 32 > file
    ("  " + MAC_HEX[:32].upper() + " \n", bytes.fromhex(MAC_HEX[:32])),
    (bytes(range(256))[:64], bytes(range(256))[:64]),  # head -c 64 /dev/urandom > file
    (b"a passphrase of some length", b"a passphrase of some length"),
])
def test_mac_key_file_is_read_when_the_spec_is_built_and_reaches_the_workers(
        tmp_path, content, expected):
    keys = tmp_path / "keys"
    keys.mkdir()
    path = key_file(keys / "mac", content)
    spec = build({"type": "fs", "root_dir": str(tmp_path), "mac_key_file": path})
    (tier,) = spec.tiering_config.secondary_tiers
    assert tier.options.mac_secret == expected
    assert _through_the_segment(spec).tiers[0].options.mac_secret == expected
    for shown in (repr(tier.options), str(tier.options), repr(spec.tiering_config)):
        assert expected.hex() not in shown and MAC_HEX not in shown
    assert f"<secret: {len(expected)} bytes from file {path}>" in repr(tier.options)


def test_mac_key_inline_hex_reaches_the_workers_and_is_never_shown(tmp_path):
    spec = build({"type": "fs", "root_dir": str(tmp_path), "mac_key": MAC_HEX})
    (tier,) = spec.tiering_config.secondary_tiers
    read = _through_the_segment(spec).tiers[0].options
    assert read.mac_secret == bytes.fromhex(MAC_HEX)
    assert MAC_HEX not in repr(tier.options) and MAC_HEX not in repr(read)
    # without a key the workers get none
    spec = build({"type": "fs", "root_dir": str(tmp_path)})
    assert _through_the_segment(spec).tiers[0].options.mac_secret is None


def test_mac_key_errors_name_the_key_and_never_show_the_secret(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    cases = [
        ({"mac_key_file": str(keys / "absent")},
         rf"secondary_tiers\[0\]\.mac_key_file = '{keys}/absent' is invalid: expected a "
         rf"private file \(mode 600 or 400\) holding a secret of 16\.\.64 bytes, raw or as "
         rf"32\.\.128 hex digits, or null \({keys}/absent does not exist\)"),
        ({"mac_key_file": key_file(keys / "short", "0123456789abcdef")},
         r"\.mac_key_file = .* \(.*/short holds 8 bytes as hex\)"),
        ({"mac_key_file": key_file(keys / "short_raw", b"\xff" * 15)},
         r"\.mac_key_file = .* \(.*/short_raw holds 15 bytes\)"),
        ({"mac_key_file": key_file(keys / "long", "ab" * 65)},
         r"\.mac_key_file = .* \(.*/long holds 65 bytes as hex\)"),
        ({"mac_key_file": key_file(keys / "huge", b"\x01" * 5000)},
         r"\.mac_key_file = .* \(.*/huge holds 5000 bytes, more than a key\)"),
        ({"mac_key_file": key_file(keys / "empty", b"")},
         r"\.mac_key_file = .* \(.*/empty holds 0 bytes\)"),
        ({"mac_key_file": key_file(keys / "world", MAC_HEX, 0o644)},
         r"\.mac_key_file = .* \(.*/world is accessible by group or others \(mode 0644\); "
         r"make it private: chmod 600 .*/world\)"),
        ({"mac_key_file": key_file(keys / "group", MAC_HEX, 0o640)},
         r"/group is accessible by group or others \(mode 0640\)"),
        ({"mac_key_file": str(keys)}, r"\.mac_key_file = .* is not a regular file"),
        ({"mac_key_file": 7}, r"\.mac_key_file = 7 is invalid: expected a private file"),
        ({"mac_key": MAC_HEX[:30]},
         r"\.mac_key = <secret, not shown> is invalid: expected a secret of 16\.\.64 bytes as "
         r"32\.\.128 hex digits, or null \(15 bytes\)"),
        ({"mac_key": MAC_HEX + "zz"},
         r"\.mac_key = <secret, not shown> is invalid: .* \(not an even number of hex digits\)"),
        ({"mac_key": 12345}, r"\.mac_key = <secret, not shown> is invalid: .* \(got int\)"),
        ({"mac_key": MAC_HEX, "mac_key_file": key_file(keys / "ok", MAC_HEX)},
         r"secondary_tiers\[0\]\.mac_key_file and secondary_tiers\[0\]\.mac_key are both set"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigError, match=message) as ei:
            build({"type": "fs", "root_dir": str(tmp_path), **options})
        assert MAC_HEX not in str(ei.value) and MAC_HEX[:30] not in str(ei.value)
        assert no_segment_made()
    if os.geteuid() != 0:  # root reads any file
        unreadable = key_file(keys / "unreadable", MAC_HEX, 0o000)
        with pytest.raises(ConfigError, match=r"/unreadable cannot be read: EACCES"):
            build({"type": "fs", "root_dir": str(tmp_path), "mac_key_file": unreadable})


def test_max_bytes_counts_the_mac_tag(tmp_path):
    one_file = 8192 + 40 + 40  # KV, frame header, 40-byte key (LAYOUT: one 8 KiB chunk)
    build({"type": "fs", "root_dir": str(tmp_path), "max_bytes": one_file})
    with pytest.raises(ConfigError, match=rf"\.max_bytes = {one_file} is invalid: expected at "
                                          rf"least one chunk's file \({one_file + 32} bytes"):
        build({"type": "fs", "root_dir": str(tmp_path), "max_bytes": one_file,
               "mac_key": MAC_HEX})


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
