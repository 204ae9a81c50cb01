"""Issue 28, defects 2 and 3: secrets never reach an error, a log line or ``shmtier
ls``/``top``.

- A URL with a password in it (``endpoint_override``, or any value a ConfigError quotes)
  is shown with its user part as ``***@``.
- A real run at ``SHMTIER_LOG=DEBUG`` (an engine's scheduler with spawned tier workers, an
  obj tier on moto's S3 server with access key, secret key and session token and a MAC
  key, a p2p tier with its CurveZMQ secret key given inline), with botocore's debug output
  asked for by name (``SHMTIER_LOG_THIRD_PARTY``) and the embedding application's root
  logger at DEBUG: nothing the run writes (the workers' stderr, the scheduler's log, the
  p2p endpoint's, ``shmtier ls``/``top``) holds any of the secrets, while botocore's wire
  log did run (its header lines are there, redacted). Third-party loggers not named stay
  quiet in the tier workers.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from shmtier.config import ConfigError, TieringConfig

HERE = Path(__file__).parent
PASSWORD = "hunter2-PASSWORD"


@pytest.mark.parametrize("endpoint", [
    f"http://AKIAEXAMPLE:{PASSWORD}@127.0.0.1:9000",  # the probe's case
    f"AKIAEXAMPLE:{PASSWORD}@127.0.0.1:9000",  # no scheme: store_config.scheme's
    f"https://user:{PASSWORD}@127.0.0.1:99999",  # and a port out of range
    f"http://user:{PASSWORD}@127.0.0.1:9000/a/path",
    f"ftp://user:{PASSWORD}@127.0.0.1",
    f"http://{PASSWORD}@127.0.0.1:9000",  # a token as the user name
    f"http://user:{PASSWORD}@127.0.0.1:port",
])
def test_a_password_in_endpoint_override_is_not_in_the_error(endpoint):
    tier = {"type": "obj", "store_config": {"bucket": "b-1", "endpoint_override": endpoint}}
    with pytest.raises(ConfigError) as e:
        TieringConfig.from_extra_config({"secondary_tiers": [tier]})
    text = str(e.value)
    assert PASSWORD not in text, text
    assert "secondary_tiers[0].store_config.endpoint_override = " in text, text
    assert "***@127.0.0.1" in text, text


@pytest.mark.parametrize("extra", [
    {"cpu_bytes_to_use": f"http://u:{PASSWORD}@host/"},
    {"cpu_bytes_to_use": 1 << 20, "tier_poll_window": f"https://u:{PASSWORD}@host:1/x"},
    {"cpu_bytes_to_use": 1 << 20,
     "secondary_tiers": [{"type": "example", "custom_param": f"s3://u:{PASSWORD}@bucket"}]},
])
def test_any_error_quoting_a_url_hides_its_password(extra):
    from shmtier.config import KVLayout, PrimaryTierConfig

    with pytest.raises(ConfigError) as e:
        PrimaryTierConfig.from_extra_config(extra, KVLayout("m", "bfloat16", 16, 8192))
        TieringConfig.from_extra_config(extra)
    assert PASSWORD not in str(e.value) and "***@" in str(e.value), str(e.value)


def test_fsck_with_a_password_in_the_endpoint_does_not_print_it():
    out = subprocess.run(
        [sys.executable, "-m", "shmtier", "fsck", "--bucket", "b-1", "--endpoint",
         f"http://user:{PASSWORD}@127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert PASSWORD not in out.stdout + out.stderr and "***@" in out.stderr, out.stderr


def _run(config: dict, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "secrets_engine.py"), json.dumps(config)],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, **env}, cwd=HERE)


def test_debug_logs_of_a_run_with_every_secret_set_hold_none_of_them(moto_s3, engine_id):
    zmq = pytest.importorskip("zmq")
    pytest.importorskip("boto3")
    bucket = moto_s3.new_bucket("secrets")
    secret_key = f"S3CRET-{uuid.uuid4().hex}"
    session_token = f"T0KEN-{uuid.uuid4().hex}{uuid.uuid4().hex}"
    mac_key = secrets.token_hex(32)
    curve_public, curve_secret = (k.decode() for k in zmq.curve_keypair())
    peer_public = zmq.curve_keypair()[0].decode()
    password = f"PW-{uuid.uuid4().hex}"
    config = {
        "engine_id": engine_id,
        "root_debug": True,
        "obj": {"type": "obj", "mac_key": mac_key,
                "store_config": moto_s3.store_config(bucket, secret_key=secret_key,
                                                     session_token=session_token)},
        "p2p": {"type": "p2p", "host": "127.0.0.1", "port": 0, "secret_key": curve_secret,
                "public_key": curve_public, "allow_keys": [peer_public]},
        "refused": {"type": "obj", "store_config": {
            "bucket": bucket, "endpoint_override": f"http://AKIA:{password}@{moto_s3.host_port}"}},
    }
    out = _run(config, {"SHMTIER_LOG": "DEBUG", "SHMTIER_LOG_THIRD_PARTY": "botocore=DEBUG"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert "promoted 4 chunks from the bucket" in text  # PUTs, HEADs and GETs ran
    assert "config refused: " in text and "***@" in text  # the refused URL was logged
    leaked = {name: value for name, value in (
        ("secret_key", secret_key), ("session_token", session_token),
        ("mac_key", mac_key), ("mac_key (upper case)", mac_key.upper()),
        ("p2p secret_key", curve_secret), ("URL password", password)) if value in text}
    assert not leaked, f"secrets in the run's output: {sorted(leaked)}"
    lines = text.splitlines()
    # the wire logs ran, in the scheduler (the root logger at DEBUG) and in the tier
    # workers (asked for by name), and their credential headers were redacted
    worker = [line for line in lines if "tier-worker" in line]
    assert any("botocore" in line for line in worker), "no botocore output from tier workers"
    assert any("x-amz-security-token" in line.lower() for line in lines)
    assert not any("urllib3" in line for line in worker), "urllib3 was not asked for"
    assert '"bucket": "' + bucket in out.stdout  # ls/top printed the tier (no secrets)


def test_third_party_debug_stays_off_in_tier_workers_unless_named(moto_s3, engine_id):
    pytest.importorskip("zmq")
    pytest.importorskip("boto3")
    import zmq

    bucket = moto_s3.new_bucket("quiet")
    session_token = f"T0KEN-{uuid.uuid4().hex}"
    config = {
        "engine_id": engine_id,
        "obj": {"type": "obj", "store_config": moto_s3.store_config(
            bucket, session_token=session_token)},
        "p2p": {"type": "p2p", "host": "127.0.0.1", "port": 0,
                "secret_key": zmq.curve_keypair()[1].decode(),
                "allow_keys": [zmq.curve_keypair()[0].decode()]},
        "refused": {"type": "obj", "store_config": {"bucket": bucket,
                                                    "endpoint_override": "ftp://x"}},
    }
    out = _run(config, {"SHMTIER_LOG": "DEBUG", "SHMTIER_LOG_THIRD_PARTY": ""})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert session_token not in text
    for name in ("botocore", "urllib3", "boto3"):
        assert name not in text, f"{name} logged without being asked for:\n{text[-3000:]}"


@pytest.mark.parametrize("env, shown, hidden", [
    ({"SHMTIER_LOG": "debug"}, ["DEBUG w [", "shmtier.x: fine detail"], ["3rd"]),
    ({"SHMTIER_LOG": "verbose"}, ["'verbose' is not a logging level", "shmtier.x: trouble"],
     ["fine detail"]),
    ({"SHMTIER_LOG": "INFO", "SHMTIER_LOG_THIRD_PARTY": "thirdparty=DEBUG"},
     ["thirdparty: 3rd", "Authorization: ***", "shmtier.x: trouble"], ["fine detail", "AWS4"]),
    ({"SHMTIER_LOG_THIRD_PARTY": "shmtier=DEBUG thirdparty=LOUD"},
     ["'shmtier=DEBUG' is not a third-party logger", "thirdparty='LOUD' is not a logging",
      "shmtier.x: trouble"], ["fine detail", "3rd"]),
])
def test_a_workers_log_set_up_follows_the_environment_and_never_stops_it(env, shown, hidden):
    """configure_logging as a tier worker's main calls it: a level in any case, a bad
    one reported in a WARNING (before: basicConfig raised, and the worker died at start)."""
    code = ("import logging; from shmtier.shared.log_setup import configure_logging; "
            "configure_logging('w'); log = logging.getLogger('shmtier.x'); "
            "log.debug('fine detail'); log.warning('trouble'); "
            "logging.getLogger('thirdparty').debug("
            "'3rd: Authorization: AWS4-HMAC-SHA256 Credential=A/B, Signature=c')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMTIER_LOG")} | env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    for text in shown:
        assert text in out.stderr, out.stderr
    for text in hidden:
        assert text not in out.stderr, out.stderr
