"""A real vLLM OpenAI API server in its own process group, for the e2e suite.

:class:`Server` starts ``python -m vllm.entrypoints.openai.api_server`` (the interpreter
running the tests: the cpu-0.32 environment) on a free 127.0.0.1 port, with the suite's
fixed engine flags (:func:`engine_args`) and, when given, a ``--kv-transfer-config``
naming shmtier (:func:`kv_config`). ``start()`` returns at once; ``wait_ready()`` waits
for ``/health`` (and raises with the log's tail if the server exits first), then sends
one short warm-up request; ``stop()`` sends SIGTERM to the API server, SIGKILL to its
process group after ``grace_s``, waits until no process of the group is left and returns
the shmtier entries of its engine still in /dev/shm and the p2p socket directories it left
(which it then removes, so that a failing test leaves the machine clean: the caller
asserts on what it returned). Everything runs in the pytest process; ``stop()`` never
raises.

Each server has a temp dir of its own (``TMPDIR``, under the suite's temp dir): vLLM's
ipc sockets and distributed-init files, which its processes leave when they are stopped,
and shmtier's p2p socket directories land there, and ``stop()`` removes it. ``top()``
runs ``shmtier top`` with the same ``TMPDIR``, as an operator does.

The flags every server gets, with offloading or not (a reference server is the same
command minus ``--kv-transfer-config``): ``--dtype bfloat16``, ``--enforce-eager`` (no
torch.compile: the suite's start-up budget), ``--block-size 32`` (the CPU attention
backend's smallest), ``--max-model-len``, ``--num-gpu-blocks-override`` (a device cache
of a few prompts, so that prefixes come back from shmtier's tiers), ``--seed 0``; and the
environment ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM reserves a core when a KV connector
is set, which changes the OMP thread count and with it bf16 rounding: every server
reserves one), ``VLLM_CPU_KVCACHE_SPACE=1`` (1 GiB: without it the CPU worker asks for
92% of the node's memory and refuses to start on a shared machine),
``VLLM_SERVER_DEV_MODE=1`` (``POST /reset_prefix_cache``), ``HF_HUB_OFFLINE=1``. With
``SHMTIER_E2E_DEVICE=cuda`` (a CUDA vLLM on a GPU: scripts/test-e2e-gpu) the two CPU
variables are left out and each server takes a fifth of the GPU's memory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from s3_servers import free_port

from shmtier.tiers.p2p import socket_dirs

from . import e2e_model

SHM_DIR = "/dev/shm"
BLOCK_SIZE = 32            # tokens per device block and per shmtier chunk
MAX_MODEL_LEN = 512
GPU_BLOCKS = 24            # 768 tokens of device cache
SERVED_NAME = "e2e-llama"
#: the request header by which vLLM's API server sends a request to one data-parallel
#: replica (its rank), instead of the least loaded one
DP_RANK_HEADER = "X-data-parallel-rank"

#: ``cpu`` (vllm-cpu, scripts/test-e2e) or ``cuda`` (a CUDA build of vLLM on a GPU,
#: scripts/test-e2e-gpu): the ``SHMTIER_E2E_DEVICE`` environment variable
DEVICE = os.environ.get("SHMTIER_E2E_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"SHMTIER_E2E_DEVICE={DEVICE!r}: accepted are 'cpu' and 'cuda'")

_CPU_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
BASE_ENV = {
    **(_CPU_ENV if DEVICE == "cpu" else {}),
    "VLLM_SERVER_DEV_MODE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def engine_args(model_dir: str) -> list[str]:
    """The engine flags every server of the suite gets (reference or not)."""
    return ["--model", model_dir, "--served-model-name", SERVED_NAME,
            "--dtype", "bfloat16", "--enforce-eager", "--seed", "0",
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", str(GPU_BLOCKS),
            "--disable-uvicorn-access-log",
            # on a GPU: several servers share it (the suite runs up to three at once)
            *(["--gpu-memory-utilization", "0.2"] if DEVICE == "cuda" else [])]


#: bytes of one chunk (one device block: K and V of every layer, bf16)
ROW_BYTES = (e2e_model.LAYERS * 2 * e2e_model.KV_HEADS
             * (e2e_model.HIDDEN // e2e_model.HEADS) * BLOCK_SIZE * 2)


def kv_config(engine_id: str, *, cpu_rows: int, tiers: list[dict] | None = None,
              **extra: Any) -> dict:
    """A ``--kv-transfer-config`` naming shmtier: a CPU tier of ``cpu_rows`` chunks of one
    device block each, ``tiers`` as ``secondary_tiers``, ``extra`` further keys of
    ``kv_connector_extra_config``."""
    cfg = {"spec_name": "ShmTierOffloadingSpec", "spec_module_path": "shmtier.vllm",
           "cpu_bytes_to_use": cpu_rows * ROW_BYTES, "block_size": BLOCK_SIZE,
           "secondary_tiers": list(tiers or [])}
    cfg.update(extra)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "engine_id": engine_id, "kv_connector_extra_config": cfg}


def shm_entries(engine_id: str) -> list[str]:
    """This engine's shmtier entries in /dev/shm: its segment(s) (``shmtier_<id>``, a
    data-parallel suffix included) and their ring semaphores."""
    stem = f"shmtier_{engine_id}"
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names
                  if n == stem or n.startswith(stem + "_dp") or n.startswith(f"sem.{stem}."))


def p2p_dirs_left(tmp_dir: str, engine_id: str, wait_s: float = 5.0) -> list[str]:
    """The p2p socket directories of engine ``engine_id`` (its replicas' included) left in
    ``tmp_dir`` once its processes are gone, waited for up to ``wait_s`` (a killed engine's
    segment guardian removes them just after its death)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            names = os.listdir(tmp_dir)
        except FileNotFoundError:
            return []
        left = sorted(n for n in names if n.startswith(socket_dirs.DIR_PREFIX)
                      and socket_dirs.engine_of(n).split("_dp")[0] == engine_id)
        if not left or time.monotonic() > deadline:
            return [os.path.join(tmp_dir, n) for n in left]
        time.sleep(0.1)


def node_pools(kv: dict) -> list[str]:
    """The node pools a :func:`kv_config`'s engine joins: each ``node`` secondary tier's
    ``pool``, or (null) the engine id without vLLM's data-parallel suffix."""
    from shmtier.tiers.node.config import default_pool_name
    tiers = kv["kv_connector_extra_config"].get("secondary_tiers") or []
    return [t.get("pool") or default_pool_name(kv["engine_id"])
            for t in tiers if t.get("type") == "node"]


def abandoned_pools(pools: list[str]) -> list[str]:
    """The /dev/shm entries of those of ``pools`` that exist with no live engine in them
    (a pool another server still uses is its, not a leftover)."""
    from shmtier.tiers.node.layout import shm_name
    from shmtier.tiers.node.tools import read_status
    out = []
    for pool in pools:
        status = read_status(pool)
        if status is not None and status.live_engines == 0:
            out.append(shm_name(pool).lstrip("/"))
    return out


def remove_shm(entries: list[str]) -> None:
    for name in entries:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def mapped_shm(pids: list[int]) -> set[str]:
    """The /dev/shm entries that processes ``pids`` map or hold open (POSIX shared memory
    and named semaphores: vLLM's message queues, multiprocessing's locks)."""
    found = set()
    prefix = SHM_DIR + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        name = line[at + len(prefix):].rstrip("\n")
                        found.add(name.removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    found.add(target[len(prefix):].removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


def group_pids(pgid: int) -> list[int]:
    """Live processes (zombies excluded) whose process group is ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


#: The watchdog of one server (a process of its own): it blocks reading its stdin, a pipe
#: the test process holds; at EOF (the test process ended, however it ended, or ``stop()``
#: closed it) it stops the server's process group: SIGTERM, SIGKILL 5 s later. vLLM 0.32's
#: EngineCore and model worker outlive a SIGKILLed API server, so the whole group is its job.
_WATCHDOG = """
import os, signal, sys, time
pgid = int(sys.argv[1])
sys.stdin.buffer.read()
for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        break
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            sys.exit(0)
        time.sleep(0.1)
"""


class ServerError(RuntimeError):
    """A server did not start, or exited when it should not have."""


class Server:
    """One API server. ``name`` labels it in logs and the report; ``kv`` is a
    :func:`kv_config` dict (None: a reference server without offloading);
    ``data_parallel_size`` > 1 runs that many replicas (``--data-parallel-size``: one
    EngineCore and model worker each, engine ids ``<engine_id>_dp<rank>``; a request goes
    to one by :data:`DP_RANK_HEADER`)."""

    _starting: set["Server"] = set()  # started, not yet ready (or failed)
    started: list["Server"] = []  # every server started in this session, in order

    def __init__(self, name: str, model_dir: str, log_dir: str, *, kv: dict | None = None,
                 shutdown_timeout_s: float | None = None, env: dict | None = None,
                 args: list[str] | None = None, data_parallel_size: int = 1):
        self.name = name
        self.data_parallel_size = data_parallel_size
        self.kv = kv
        self.engine_id = kv["engine_id"] if kv else None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"{name}-{self.port}.log")
        # short: a p2p socket's path in it must fit in sun_path (108 bytes)
        self.tmp_dir = os.path.join(log_dir, f"t{self.port}")
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    *engine_args(model_dir), "--host", "127.0.0.1", "--port", str(self.port)]
        if kv is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv)]
        if shutdown_timeout_s is not None:
            self.cmd += ["--shutdown-timeout", str(shutdown_timeout_s)]
        if data_parallel_size > 1:
            self.cmd += ["--data-parallel-size", str(data_parallel_size)]
        self.cmd += list(args or [])
        self.env = {**os.environ, **BASE_ENV, "TMPDIR": self.tmp_dir, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self.started_at = 0.0
        self.startup_s: float | None = None
        #: other servers that were starting at some point while this one started (the
        #: report compares start-up times of servers that started alone)
        self.overlapped = 0
        self._client = None
        #: /dev/shm entries of vLLM's own (not shmtier's) that the server's processes
        #: mapped once it served; ``stop()`` removes those its processes left behind
        self.vllm_shm: set[str] = set()
        #: what ``stop()`` removed of them (an EngineCore killed outright leaves its
        #: message queues' segments: vLLM's resource tracker dies with the group)
        self.vllm_shm_left: list[str] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Server":
        """Start the server in a process group of its own, with a watchdog that stops
        that group when the test process ends without stopping it (:data:`_WATCHDOG`)."""
        os.makedirs(self.tmp_dir, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(self.proc.pid)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.started_at = time.monotonic()
        for other in Server._starting:
            other.overlapped += 1
            self.overlapped += 1
        Server._starting.add(self)
        Server.started.append(self)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float | None = None) -> "Server":
        """Wait until ``GET /health`` answers 200; :class:`ServerError` with the log's
        tail when the server exits or is not ready within ``timeout_s`` (default 180 s
        per data-parallel replica: each loads its own engine on the same cores)."""
        if timeout_s is None:
            timeout_s = 180.0 * self.data_parallel_size
        try:
            return self._wait_ready(timeout_s)
        finally:
            Server._starting.discard(self)

    def _wait_ready(self, timeout_s: float) -> "Server":
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise ServerError(f"server {self.name} exited with {self.proc.returncode} "
                                  f"while starting:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - self.started_at
                        self.warm_up()
                        self.vllm_shm = {n for n in mapped_shm(group_pids(self.proc.pid))
                                         if not n.startswith(("shmtier_", "sem.shmtier_"))}
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise ServerError(f"server {self.name} not ready within {timeout_s:.0f}s:\n"
                          f"{self.log_tail()}")

    def warm_up(self) -> None:
        """One short request (fewer tokens than a block: nothing is stored or looked up).

        vllm-cpu 0.32 on this machine (AMX) kills its model worker with SIGILL in
        ``cpu_attention_with_kv_cache`` when the engine's first forward pass computes a
        single token on top of a prefix a KV connector loaded (a first request whose whole
        prompt is a hit, e.g. on a p2p decoder); once any request ran, the same request
        works. Every server therefore answers one request before its scenario starts, on
        each of its data-parallel replicas."""
        ranks = range(self.data_parallel_size) if self.data_parallel_size > 1 else [None]
        for rank in ranks:
            self.client.chat.completions.create(
                model=SERVED_NAME, messages=[{"role": "user", "content": "warm up"}],
                temperature=0, max_tokens=2, extra_headers=self.dp_headers(rank))

    def dp_headers(self, rank: int | None) -> dict[str, str] | None:
        """The request headers that send a request to data-parallel replica ``rank``
        (None: no header, vLLM picks the least loaded replica)."""
        if rank is None:
            return None
        if not 0 <= rank < self.data_parallel_size:
            raise ValueError(f"dp_rank={rank}: server {self.name} has "
                             f"{self.data_parallel_size} data-parallel replica(s)")
        return {DP_RANK_HEADER: str(rank)}

    def stop(self, grace_s: float = 30.0, *, keep_shm: bool = False) -> list[str]:
        """Stop the server as an operator does (SIGTERM to the API server, which stops
        its engine; vLLM's ``--shutdown-timeout`` decides how long the engine drains),
        then SIGKILL whatever of its process group is left after ``grace_s``; wait until
        none of it is left and return this engine's shmtier entries still in /dev/shm
        (then removed; ``keep_shm``: neither, for a warm restart), with the node pools it
        joined that are left with no live engine. vLLM's own entries
        that its processes left (``vllm_shm``) are removed too, and listed in
        ``vllm_shm_left``. Never raises; a second call returns [].

        SIGTERM goes to the API server alone, not to the group: a signal to every
        process at once (Ctrl-C in a terminal, a control-group stop) reaches vLLM's
        model worker too, and vLLM 0.32's EngineCore then exits without its teardown,
        so shmtier's close never runs (the segment guardian removes the segment)."""
        if self._client is not None:
            self._client.close()
            self._client = None
        proc, self.proc = self.proc, None
        if proc is None:
            return []
        pgid = proc.pid
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5.0  # its children exit after it
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill_group(pgid)
        proc.wait()
        if self._watchdog is not None:
            self._watchdog.stdin.close()  # its group is gone: it exits at once
            self._watchdog.wait()
            self._watchdog = None
        self.vllm_shm_left = sorted(n for n in self.vllm_shm
                                    if os.path.exists(os.path.join(SHM_DIR, n)))
        remove_shm(self.vllm_shm_left)
        leftovers = []
        if self.engine_id and not keep_shm:
            leftovers = shm_entries(self.engine_id) + abandoned_pools(node_pools(self.kv))
            remove_shm(leftovers)
            leftovers += p2p_dirs_left(self.tmp_dir, self.engine_id)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return leftovers

    @staticmethod
    def kill_group(pgid: int, timeout_s: float = 10.0) -> None:
        """SIGKILL every process of group ``pgid`` until none is left (processes that
        left the group with setsid are not found here)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = group_pids(pgid)
            if not pids or time.monotonic() > deadline:
                return
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                return
            time.sleep(0.05)

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------ HTTP

    @property
    def client(self):
        """An ``openai.OpenAI`` client for this server (no retries)."""
        if self._client is None:
            import openai
            self._client = openai.OpenAI(base_url=self.url + "/v1", api_key="e2e",
                                         max_retries=0, timeout=120)
        return self._client

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def post(self, path: str) -> Any:
        req = urllib.request.Request(self.url + path, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            body = r.read().decode()
        return json.loads(body) if body else None

    def metrics_text(self) -> str:
        return self.get("/metrics")

    # ------------------------------------------------------------------ processes

    def engine_core_pid(self) -> int:
        """The EngineCore process: the owner of this engine's shmtier segment."""
        return self.top()["owner_pid"]

    def top(self) -> dict:
        """``shmtier top ENGINE --once --json`` of this engine (segment, tier workers)."""
        out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "shmtier"),
                              "top", self.engine_id, "--once", "--json", "--interval", "0.1"],
                             capture_output=True, text=True, timeout=60, check=True,
                             env={**os.environ, "TMPDIR": self.tmp_dir})
        return json.loads(out.stdout)
