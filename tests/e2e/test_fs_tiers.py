"""shmtier's CPU tier and fs tier in a real vLLM server (issue 27, scenarios a, b, c-fs).

One chain of servers on one fs root, so that each server start serves a scenario: (a) a
server with a CPU and an fs tier; (b) it stops and a new one starts on the same root;
(c) a second server starts on that root next to it. Every answer is compared token for
token with the same engine without offloading; every step that should be served by a
tier asserts it from the server's /metrics (``e2e_metrics.assert_tier_served``).
"""

from __future__ import annotations

import pytest

from .e2e_chats import Conversations, flush
from .e2e_metrics import (CHECKSUM_FAILURES, CPU_TIER, Metrics, assert_tier_served,
                         tier_figures)
from .e2e_server import kv_config
from .e2e_tiers import (CPU_ROWS, FLUSH_CPU, FLUSH_DEVICE, corrupt_kv_files, fs_tier,
                       kv_files, probe_tiers, wait_stable)

#: servers start in tens of seconds on 2 cores (more on a busy host)
pytestmark = pytest.mark.timeout(600)

FS = "1:fs"


def test_cpu_fs_tiers_restart_and_shared_root(serve, cmp, prompts, report):
    """(a) Four concurrent multi-turn chats: turn 2 after the device cache was flushed is
    served by the CPU tier, turn 3 after the CPU tier was flushed too by the fs tier.
    (b) The server stops cleanly (``--shutdown-timeout``: nothing of it stays in
    /dev/shm) and a new one on the same fs root serves the chats' prefixes from it.
    (c) A second server started on the same root gets fs hits for prefixes the first
    computes. Then the negative check: chunk files the first wrote are corrupted before
    the second asks for them; it refuses every one (checksum), recomputes (answers
    unchanged), and the suite's fs assertion sees no fs hit."""
    root = serve.dir("fs-a")
    kv = kv_config(serve.engine_id("a"), cpu_rows=CPU_ROWS, tiers=[fs_tier(root)],
                   num_tier_workers=2)
    a = serve("a-cpu+fs", kv, shutdown_timeout_s=30)
    chats = Conversations(prompts, n=4, tag="a")

    chats.turn(cmp, a)
    flush(cmp, a, prompts, FLUSH_DEVICE)
    before = Metrics.scrape(a)
    chats.turn(cmp, a)
    assert_tier_served(Metrics.scrape(a) - before, CPU_TIER, "turn 2 after a device flush")

    flush(cmp, a, prompts, FLUSH_CPU)
    before = Metrics.scrape(a)
    chats.turn(cmp, a)
    assert_tier_served(Metrics.scrape(a) - before, FS, "turn 3 after a CPU tier flush")
    probe = probe_tiers(cmp, a, prompts, report, "a: one server", "a")
    cmp.assert_identical()
    report.scenario("a: CPU + fs tiers, 4 concurrent chats x 3 turns", cmp.asked,
                    "turn 2 from the CPU tier, turn 3 from fs; probe cold/CPU/fs/device")
    asked = cmp.asked

    # (b) restart; (c)'s second server starts at the same time
    assert serve.stop(a) == [], "a clean stop (--shutdown-timeout 30) left /dev/shm entries"
    a2 = serve.start("b-restarted", kv, shutdown_timeout_s=30)
    y = serve.start("c-fs-second", kv_config(serve.engine_id("c"), cpu_rows=CPU_ROWS,
                                             tiers=[fs_tier(root)]))
    serve.ready(a2, y)
    before = Metrics.scrape(a2)
    chats.replay(cmp, a2)
    assert_tier_served(Metrics.scrape(a2) - before, FS, "the chats' prefixes after a restart")
    before = Metrics.scrape(a2)
    answer = cmp.ask(a2, probe, label="probe after restart")
    assert_tier_served(Metrics.scrape(a2) - before, FS, "the probe after a restart")
    report.ttft("b: restarted on the same fs root", FS, answer)
    cmp.assert_identical()
    report.scenario("b: restart on the same fs root", cmp.asked - asked,
                    "every chat's last prompt and the probe served from fs")
    asked = cmp.asked

    # (c) the restarted server computes new prefixes; the second one reads them
    known = set(kv_files(root))
    shared = Conversations(prompts, n=3, tag="c-fs")
    shared.turn(cmp, a2)
    shared.turn(cmp, a2)
    new = lambda: [p for p in kv_files(root) if p not in known]  # noqa: E731
    wait_stable(lambda: len(new()), at_least=3)
    before = Metrics.scrape(y)
    answers = shared.replay(cmp, y)
    assert_tier_served(Metrics.scrape(y) - before, FS, "prefixes the other server computed")
    for ans in answers:
        report.ttft("c: shared fs root, the other server's prefix", FS, ans)

    # negative: the same, with the chunk files damaged before the second server reads them
    known = set(kv_files(root))
    bad = Conversations(prompts, n=2, tag="c-fs-corrupt")
    bad.turn(cmp, a2)
    wait_stable(lambda: len(new()), at_least=2)
    assert corrupt_kv_files(new()) > 0
    before = Metrics.scrape(y)
    bad.replay(cmp, y)
    d = Metrics.scrape(y) - before
    with pytest.raises(AssertionError, match="served nothing"):
        assert_tier_served(d, FS, "corrupted chunk files")
    assert d.value(CHECKSUM_FAILURES) > 0, "the corrupted chunks were not refused"
    cmp.assert_identical()
    figures = ", ".join(f"{k} {v:g}" for k, v in tier_figures(d, FS).items())
    report.scenario("c: two servers, one fs root", cmp.asked - asked,
                    "the other server's prefixes are fs hits; with its files corrupted: "
                    f"checksum failures {d.value(CHECKSUM_FAILURES):g}, {figures}")
