"""The p2p tier's scheduler half <-> endpoint channel (shmtier/tiers/p2p/channel.py): every
message round-trips with its type; what a side cannot read is an ERROR naming it, never an
exception in its loop; an endpoint of another channel version is a clear error naming both
versions, and (the real endpoint process, announcing another version) is killed and not
restarted."""

from __future__ import annotations

import logging
import os
import time

import msgpack
import pytest

pytest.importorskip("zmq")

from shmtier.tiers.p2p import channel  # noqa: E402
from shmtier.tiers.p2p.channel import (VERSION, Answer, Complete, Counters, ExtLookup,  # noqa: E402
                                       Load, LoadDone, Lookup, LookupDone, Park, Ready,
                                       Release, Released, Stop, Unpark, VersionMismatch)

KEYS = [b"\x00" * 36, bytes(range(36))]

TO_ENDPOINT = [
    Park("kv-1", KEYS, [3, 4]),
    Park("kv-1", KEYS[:1], [5], ["10.0.0.2:5601", "rq:P+&K8Qe6>v7}y}0#fQ=H!RSb^G(N7i/Oq&Dw?"]),
    Park("kv-2", KEYS, [6, 7], ["10.0.0.2:5601", ""]),
    Complete("kv-1"),
    Unpark("kv-1"),
    Load(7, "kv-1", "10.0.0.2:5601", None, KEYS, [8, 9]),
    Load(8, "kv-1", "10.0.0.2:5601", "Z85serverkey", [], []),
    Lookup(3, "kv-3", "10.0.0.3:5601", "Z85serverkey", KEYS),
    Release("kv-1", "10.0.0.2:5601", None),
    Answer(11, [True, False], "kv-4", KEYS[:1], [10]),
    Stop(),
]
TO_SCHEDULER = [
    Ready(VERSION, 5601),
    LoadDone(7, [0, 1], 2 * 8192, 0.0125, ""),
    LoadDone(8, [], 0, 0.0, "timeout: 2 chunks not offered by 10.0.0.2:5601 within 3 s"),
    LookupDone(3, [True, False], ""),
    LookupDone(4, None, "circuit open"),
    Released("kv-1"),
    Released("kv-1", KEYS[:1]),
    ExtLookup(12, "kv-5", "10.0.0.3:5601", KEYS),
    Counters({"requests": 3, "refused_handshakes": {"no_key": 1}}, {"10.0.0.2:5601": 16384},
             {"10.0.0.2:5601": {"bytes_received": 8192, "refused_handshakes": {}}}),
]


def test_every_message_round_trips_with_its_type_and_order():
    assert {type(m) for m in TO_ENDPOINT} == set(channel._TO_ENDPOINT.values())
    assert {type(m) for m in TO_SCHEDULER} == set(channel._TO_SCHEDULER.values())
    got = channel.from_scheduler(channel.encode(TO_ENDPOINT))  # a step's frame
    assert got == TO_ENDPOINT and [type(m) for m in got] == [type(m) for m in TO_ENDPOINT]
    for msg in TO_SCHEDULER:  # the endpoint sends one a frame
        (back,) = channel.from_endpoint(channel.encode((msg,)))
        assert back == msg and type(back) is type(msg)
    assert channel.from_scheduler(channel.encode(())) == []


def test_what_a_side_cannot_read_is_logged_and_dropped(caplog):
    """An unknown tag (or one of the other direction), a wrong number of fields, a frame
    that is not an array of messages or not msgpack: an ERROR naming it and this side's
    version; the frame's other messages still arrive."""
    park = Park("kv-1", KEYS, [1, 2])
    good = [park.TAG, *park]
    cases = [
        ([[99, "x"], good], "a message of unknown type 99", [park]),
        ([[Ready.TAG, VERSION, 1], good], "a message of unknown type 0", [park]),
        ([[Park.TAG, "kv-1"], good],
         "a Park message with 1 fields, expected 4 (req, keys, rows, to)", [park]),
        ([{"t": "park", "req": "kv-1"}, good], "a message of unknown shape {'t': 'park'", [park]),
        ({"t": "park", "req": "kv-1"}, "a frame that is not an array of messages", []),
    ]
    frames = [(msgpack.packb(v), what, want) for v, what, want in cases]
    frames.append((b"\xc1", "a frame that is not msgpack", []))
    for frame, what, want in frames:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="shmtier.tiers.p2p.channel"):
            assert channel.from_scheduler(frame) == want, what
        (record,) = caplog.records
        text = record.getMessage()
        assert what in text and "from the scheduler half" in text, text
        assert f"this side speaks channel version {VERSION}" in text, text


@pytest.mark.parametrize("frame, theirs", [
    (channel.encode([Ready(VERSION + 1, 5601)]), f"channel version {VERSION + 1}"),
    (msgpack.packb([[0, "2.0", 5601, "more"]]), "channel version '2.0'"),
    (msgpack.packb({"t": "ready", "port": 5601}), "an unversioned channel"),
    (msgpack.packb([{"t": "ready", "port": 5601}]), "an unversioned channel"),
], ids=["newer", "odd-version", "unversioned", "unversioned-batch"])
def test_a_ready_of_another_version_is_an_error_naming_both(frame, theirs):
    with pytest.raises(VersionMismatch) as err:
        channel.from_endpoint(frame)
    text = str(err.value)
    assert f"the p2p endpoint speaks {theirs}" in text, text
    assert f"this scheduler half version {VERSION}" in text, text


@pytest.mark.timeout(120)
def test_an_endpoint_of_another_channel_version_is_killed_not_restarted(
        engine_id, monkeypatch, caplog):
    """The real endpoint process, announcing channel version 99: the scheduler half kills
    it at its ``Ready`` with an ERROR naming both versions and starts no other (each would
    be the same); the tier then fetches and serves nothing (no endpoint) and shuts down
    cleanly."""
    import fs_engine
    from shmtier.tiers.p2p import supervisor

    tests = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [tests] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    monkeypatch.setenv("P2P_TEST_CHANNEL_VERSION", "99")
    monkeypatch.setattr(supervisor, "ENDPOINT_MODULE", "p2p_endpoint_version")
    engine = fs_engine.Engine(engine_id, None, tier_type="p2p", page=8192, chunks=16,
                              plaintext=True, host="127.0.0.1", port=0)
    try:
        m, p2p = engine.manager, engine.manager.tiers[0]
        assert m._poll_thread.stop()
        endpoint = p2p.endpoint
        proc = endpoint.proc
        deadline = time.monotonic() + 60
        with caplog.at_level(logging.ERROR, logger="shmtier.tiers.p2p.supervisor"):
            while endpoint.broken is None:
                assert time.monotonic() < deadline, "the endpoint's Ready never came"
                with m.lock:
                    m.on_schedule_end(fs_engine.END)
                time.sleep(0.01)
        why = endpoint.broken
        assert "the p2p endpoint speaks channel version 99" in why, why
        assert f"this scheduler half version {VERSION}" in why, why
        (record,) = [r for r in caplog.records if why in r.getMessage()]
        assert "not restarting it" in record.getMessage()
        assert not endpoint.ready and endpoint.proc is None
        assert proc.wait(10) == -9  # killed
        time.sleep(2 * supervisor.RESTART_BASE_S)
        with m.lock:
            m.on_schedule_end(fs_engine.END)
        assert endpoint.proc is None and endpoint.restarts == 1  # none started since
    finally:
        engine.close()
    assert not os.path.exists(endpoint.tmpdir)
