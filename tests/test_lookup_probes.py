"""The lookup probes of a storage tier's scheduler half (``shmtier/storage/
lookup_probes.py``): which keys are asked, when a lookup answers RETRY or MISS, and how
long a miss is remembered. Pure bookkeeping: real clock, short times."""

from __future__ import annotations

import time

from shmtier.contract import LookupResult
from shmtier.storage.lookup_probes import LookupProbes

RETRY, MISS = LookupResult.RETRY, LookupResult.MISS


def test_an_unknown_key_is_asked_once_and_answers_retry_until_answered():
    p = LookupProbes(ttl_s=0.2, timeout_s=5.0)
    assert [p.answer(b"k"), p.answer(b"k")] == [RETRY, RETRY]
    assert p.take_asked() == [b"k"] and not p.has_asked  # one probe, however often asked
    assert p.answer(b"k") is RETRY  # in flight
    p.answered(b"k", found=False)
    assert p.answer(b"k") is MISS


def test_a_miss_is_kept_while_asked_and_forgotten_ttl_after_the_last_ask():
    p = LookupProbes(ttl_s=0.15, timeout_s=5.0)
    p.answer(b"k")
    p.take_asked()
    p.answered(b"k", found=False)
    for _ in range(4):  # asked every 0.1 s: longer than the ttl in all, kept
        time.sleep(0.1)
        assert p.answer(b"k") is MISS
    time.sleep(0.2)  # nobody asked for longer than the ttl: looked for again
    p.purge()
    assert p.answer(b"k") is RETRY and p.take_asked() == [b"k"]


def test_a_probe_past_its_deadline_answers_miss_once_counted_and_its_late_answer_counts():
    p = LookupProbes(ttl_s=0.2, timeout_s=0.05)
    p.answer(b"k")
    p.take_asked()
    time.sleep(0.08)
    assert [p.answer(b"k"), p.answer(b"k")] == [MISS, MISS]
    assert p.expired == 1
    p.answered(b"k", found=True)  # the late answer: found (the tier indexes it)
    assert p.answer(b"k") is RETRY  # not known to these probes any more: asked anew


def test_a_failed_probe_or_load_is_remembered_for_the_timeout_not_the_ttl():
    p = LookupProbes(ttl_s=0.05, timeout_s=0.3)
    p.remember_miss(b"k", failed=True)
    p.load_failed(b"j")
    time.sleep(0.1)
    assert p.answer(b"k") is MISS
    assert p.failed_now(b"j") and p.has_failed and not p.failed_now(b"k")
    time.sleep(0.25)
    p.purge()
    assert not p.failed_now(b"j") and not p.has_failed
    assert p.answer(b"k") is RETRY


def test_keys_the_rings_refused_are_asked_again_first_and_clear_forgets_everything():
    p = LookupProbes(ttl_s=0.2, timeout_s=5.0)
    for k in (b"a", b"b", b"c"):
        p.answer(k)
    asked = p.take_asked()
    p.not_sent(asked[1:])
    p.answer(b"d")
    assert p.take_asked() == [b"b", b"c", b"d"]
    p.clear()
    assert not p.has_asked and not p.has_failed and p.answer(b"a") is RETRY
