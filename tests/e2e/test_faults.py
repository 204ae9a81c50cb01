"""Faults in a real vLLM server with shmtier (issue 27, scenario e).

- A tier worker SIGKILLed while a round of concurrent chats runs: every answer is
  unchanged, the pool restarts the worker, the fs tier serves again afterwards.
- ``POST /reset_prefix_cache?reset_external=true`` (vLLM's dev endpoint,
  ``VLLM_SERVER_DEV_MODE=1``): it succeeds, and afterwards the fs tier serves the
  prefixes stored before the reset and the CPU tier serves new ones.
- The EngineCore SIGKILLed (vLLM's default ``--shutdown-timeout 0``, no
  ``warm_restart``): within a few seconds nothing of the engine is left in /dev/shm.
- The same with ``warm_restart``: the segment stays, and a new server with the same
  ``engine_id`` serves the old prefixes from it.

The first two tests share one server (``module_serve``; the SIGKILL test comes second and
ends it). Answers are compared with the engine without offloading throughout.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from .e2e_chats import Conversations, flush
from .e2e_metrics import CPU_TIER, WORKER_RESTARTS, Metrics, assert_tier_served
from .e2e_server import kv_config, shm_entries
from .e2e_tiers import CPU_ROWS, FLUSH_CPU, FLUSH_DEVICE, fs_tier

#: servers start in tens of seconds on 2 cores (more on a busy host)
pytestmark = pytest.mark.timeout(600)

FS = "1:fs"
#: "within a few seconds" (issue 27): how long the SIGKILL test waits for /dev/shm
SHM_GONE_S = 5.0


@pytest.fixture(scope="module")
def faults_server(module_serve):
    root = module_serve.dir("fs-e")
    kv = kv_config(module_serve.engine_id("e"), cpu_rows=CPU_ROWS, tiers=[fs_tier(root)],
                   num_tier_workers=2)
    return module_serve("e-faults", kv)  # vLLM's default --shutdown-timeout (0)


def _live_workers(server) -> list[int]:
    return [w["pid"] for w in server.top()["workers"] if w["alive"]]


def test_tier_worker_killed_and_reset_prefix_cache(faults_server, cmp, prompts, report):
    s = faults_server
    chats = Conversations(prompts, n=3, tag="e")
    chats.turn(cmp, s)
    flush(cmp, s, prompts, FLUSH_CPU)

    # a tier worker SIGKILLed while the next round (served by the fs tier) runs
    victim = _live_workers(s)[0]
    before = Metrics.scrape(s)
    killer = threading.Timer(0.05, os.kill, (victim, signal.SIGKILL))
    killer.start()
    chats.turn(cmp, s)
    killer.join()
    deadline = time.monotonic() + 30
    while (Metrics.scrape(s) - before).value(WORKER_RESTARTS) < 1:
        assert time.monotonic() < deadline, "the killed tier worker was not restarted"
        time.sleep(0.5)
    assert victim not in _live_workers(s)
    flush(cmp, s, prompts, FLUSH_CPU)
    before = Metrics.scrape(s)
    chats.turn(cmp, s)
    assert_tier_served(Metrics.scrape(s) - before, FS, "after a tier worker was killed")
    cmp.assert_identical()
    report.scenario("e: tier worker SIGKILLed mid-round", cmp.asked,
                    "answers unchanged, worker restarted, fs serves afterwards")
    asked = cmp.asked

    # reset_prefix_cache with reset_external: succeeds (retried while blocks are held)
    deadline = time.monotonic() + 30
    while not s.post("/reset_prefix_cache?reset_external=true")["success"]:
        assert time.monotonic() < deadline, "reset_prefix_cache never succeeded"
        time.sleep(0.5)
    before = Metrics.scrape(s)
    chats.replay(cmp, s)  # stored before the reset: only the fs tier still has them
    assert_tier_served(Metrics.scrape(s) - before, FS, "prefixes stored before the reset")
    after = Conversations(prompts, n=2, tag="e-after-reset")
    after.turn(cmp, s)
    flush(cmp, s, prompts, FLUSH_DEVICE)
    before = Metrics.scrape(s)
    after.turn(cmp, s)
    assert_tier_served(Metrics.scrape(s) - before, CPU_TIER, "new prefixes after the reset")
    cmp.assert_identical()
    report.scenario("e: reset_prefix_cache?reset_external=true", cmp.asked - asked,
                    "fs serves the prefixes from before the reset, the CPU tier new ones")


def test_engine_core_sigkill_leaves_nothing_in_dev_shm(faults_server):
    s = faults_server
    assert shm_entries(s.engine_id), "the engine has no shmtier entries to begin with"
    os.kill(s.engine_core_pid(), signal.SIGKILL)
    deadline = time.monotonic() + SHM_GONE_S
    while shm_entries(s.engine_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = shm_entries(s.engine_id)
    s.stop()  # the rest of its processes; removes what is left (so the host stays clean)
    assert not left, (f"{SHM_GONE_S:.0f}s after its EngineCore was SIGKILLed the engine "
                      f"still had in /dev/shm: {left}")


def test_warm_restart_after_engine_core_sigkill(serve, cmp, prompts, report):
    kv = kv_config(serve.engine_id("w"), cpu_rows=CPU_ROWS, warm_restart=True)
    w = serve("e-warm", kv, shutdown_timeout_s=30)
    chats = Conversations(prompts, n=2, tag="e-warm")
    chats.turn(cmp, w)
    chats.turn(cmp, w)
    assert Metrics.scrape(w).value("vllm:kv_offload_store_bytes_total") > 0

    os.kill(w.engine_core_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 30  # the API server sees its engine die and exits
    while w.alive and time.monotonic() < deadline:
        time.sleep(0.2)
    serve.stop(w, keep_shm=True)
    assert shm_entries(w.engine_id), "warm_restart: the killed engine's segment is gone"

    w2 = serve("e-warm-restarted", kv, shutdown_timeout_s=30)
    before = Metrics.scrape(w2)
    answers = chats.replay(cmp, w2)
    assert_tier_served(Metrics.scrape(w2) - before, CPU_TIER,
                       "the old prefixes after a warm restart")
    for a in answers:
        report.ttft("e: warm restart after SIGKILL", CPU_TIER, a)
    cmp.assert_identical()
    report.scenario("e: EngineCore SIGKILLed, warm_restart", cmp.asked,
                    "the restarted server serves the old prefixes from the kept segment")
    assert serve.stop(w2) == [], "a clean stop after a warm restart left /dev/shm entries"
