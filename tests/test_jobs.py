"""Job and result descriptors: round trips, malformed input, splitting (with hypothesis)."""

from __future__ import annotations

import itertools
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtier.shared import jobs as jobs_mod
from shmtier.shared.jobs import (
    OPS,
    SCHEMA_VERSION,
    SUCCESS,
    Job,
    MalformedJob,
    MalformedResult,
    Outcome,
    Result,
    ResultFlag,
    decode_job,
    decode_result,
    encode_job,
    encode_result,
    pack_job,
    split_job,
    split_result,
)

KEYS = [bytes([i]) * 36 + i.to_bytes(4, "little") for i in range(3)]

EXAMPLES = [
    Job(1, "store", 0, KEYS, [5, 6, 7], {"nbytes": 4096, "codec": "zstd", "level": 1}),
    Job(2, "load", 1, KEYS[:2], [0, 1 << 40], {"nbytes": 8192, "offset": 0}),
    Job(3, "delete", 2, KEYS),
    Job(4, "probe", 0, KEYS[:1], [], {"deadline_ns": 123}),
    Job(5, "scan", 3, [], [], {"cursor": b"\x00\x01", "limit": 1000}),
    Job((1 << 64) - 1, "stop", 0),
]


@pytest.mark.parametrize("job", EXAMPLES, ids=lambda j: j.op)
def test_every_op_round_trips(job):
    raw = encode_job(job)
    assert decode_job(raw) == job
    assert pack_job(job.job_id, job.op, job.tier, job.keys, job.rows, job.args) == raw
    assert decode_job(memoryview(raw)) == job  # straight from a ring slot view too


def test_result_round_trips():
    every = list(Outcome)
    for result in [
        Result(7, every, [1 << 20, 0, 5 << 20, 0, 0, 0, 0], [900_000, 0, 3 << 20, 77, 0, 4, 0],
               [2**-6, 0.5, 0.25, 0.0, 2**-20, 3.0, 0.125], 0.5, ""),  # float32-exact
        Result(8, [], error="disk full: /data/x"),
        Result(9, [], stored_bytes=[1, 2, 3], listed=KEYS, more=True),
        Result.failed(10, "boom", 3),
        Result(11, [Outcome.OK], [4], [2**32 - 1, 0], [0.5], listed=[b"k"]),  # answered + listed
        Result(12, [Outcome.OK], [4], [4], [0.5], flags=ResultFlag.NAMESPACE_RESET),
        Result(13, [], flags=2**32 - 1),
    ]:
        decoded = decode_result(encode_result(result))
        assert decoded == result
        assert all(type(o) is Outcome for o in decoded.outcomes)
    assert Result.failed(None, "x", 1) == Result(0, [Outcome.ERROR], [0], [0], [0.0], error="x")
    assert [o.value for o in Outcome] == list(range(7))  # the wire codes
    assert (Outcome.OK, Outcome.MISS, Outcome.ERROR, Outcome.CORRUPT, Outcome.REJECTED) == (
        0, 1, 2, 3, 4)  # the codes of schema 1 kept their numbers


@pytest.mark.parametrize("result, message", [
    (Result(1, [300], [0], [0], [0.0]), "outcomes must be codes 0..6"),
    (Result(1, [7], [0], [0], [0.0]), "outcomes must be codes 0..6"),
    (Result(1, [Outcome.OK], [], [0], [0.0]), "1 outcomes need as many logical_bytes"),
    (Result(1, [Outcome.OK], [0], [0], []), "1 outcomes need as many logical_bytes"),
    (Result(1, [], [], [], [], listed=[b"k"]), "stored_bytes for them and the 1 listed keys"),
    (Result(1, [Outcome.OK], [2**32], [0], [0.0]), "logical_bytes must be ints in 0..2"),
    (Result(1, [Outcome.OK], [0], [-1], [0.0]), "stored_bytes must be ints in 0..2"),
    (Result(1, [Outcome.OK], [0], [0], [-0.5]), "seconds and codec_s must be >= 0"),
    (Result(1, [Outcome.OK], [0], [0], [float("nan")]), "seconds and codec_s must be >= 0"),
    (Result(1, [Outcome.OK], [0], [0], [1e300]), "seconds must be floats in float32 range"),
    (Result(1, [], codec_s=-1.0), "seconds and codec_s must be >= 0"),
])
def test_encode_result_refuses_what_the_wire_cannot_carry(result, message):
    with pytest.raises(ValueError, match=message):
        encode_result(result)


def test_success_per_op():
    assert SUCCESS == {"store": {Outcome.OK, Outcome.EXISTS}, "load": {Outcome.OK},
                       "delete": {Outcome.OK, Outcome.MISS}, "probe": {Outcome.OK}}


def test_unknown_op_is_rejected_at_encode():
    with pytest.raises(ValueError, match=r"unknown job op 'copy' \(accepted: store, load"):
        pack_job(1, "copy", 0, [])


def _raw(*fields):
    return msgpack.packb(list(fields), use_bin_type=True)


def _job(**over):
    fields = dict(v=SCHEMA_VERSION, kind=0, id=42, op=OPS["store"], tier=0, keys=[b"k1", b"k2"],
                  rows=[1, 2], args={})
    fields.update(over)
    return _raw(*fields.values())


MALFORMED_JOBS = [
    (b"\xc1", None, "not a msgpack message"),
    (_job()[:-4], None, "not a msgpack message"),
    (_job() + b"\x00", None, "not a msgpack message"),
    (msgpack.packb({"v": 1}), None, "expected a msgpack array, got dict"),
    (msgpack.packb(17), None, "expected a msgpack array, got int"),
    (_raw(), None, "no schema version"),
    (_job(v="1"), 42, "no schema version"),
    (_job(v=4), 42, "schema version 4, this process speaks version 3"),
    (_job(v=2), 42, "schema version 2, this process speaks version 3"),
    (_job(kind=1), 42, "message kind is result, expected job"),
    (_raw(SCHEMA_VERSION, 0, 42, 1), 42, "4 fields, 8 expected"),
    (_job(id="42"), None, "job_id must be an unsigned 64-bit int, got '42'"),
    (_job(id=-1), None, "job_id must be an unsigned 64-bit int, got -1"),
    (_job(id=True), None, "job_id must be an unsigned 64-bit int, got True"),
    (_job(op=99), 42, "op must be one of the codes"),
    (_job(op="store"), 42, "op must be one of the codes"),
    (_job(tier=-1), 42, "tier must be an int >= 0"),
    (_job(tier=1.0), 42, "tier must be an int >= 0"),
    (_job(keys=b"k1k2"), 42, "keys must be a list of bytes, got bytes"),
    (_job(keys=["k1", "k2"]), 42, "each of keys must be bytes, got str 'k1'"),
    (_job(rows={}), 42, "rows must be a list of ints"),
    (_job(rows=[1, -2]), 42, "each row must be an int >= 0, got int -2"),
    (_job(rows=[1, "2"]), 42, "each row must be an int >= 0, got str"),
    (_job(rows=[1]), 42, "store needs one row per key, got 2 keys and 1 rows"),
    (_job(op=OPS["delete"]), 42, "delete takes no rows, got 2"),
    (_job(op=OPS["stop"], rows=[]), 42, "stop takes no keys, got 2"),
    (_job(args=[]), 42, "args must be a map, got list"),
    (_job(args={1: 2}), 42, "each args key must be a str, got int"),
    (_job(args={"nbytes": "4096"}), 42, r"args\['nbytes'\] must be int \(>= 0\), got str"),
    (_job(args={"nbytes": -1}), 42, r"args\['nbytes'\] must be int \(>= 0\)"),
    (_job(args={"codec": 1}), 42, r"args\['codec'\] must be str, got int"),
    (_job(args={"cursor": "x"}), 42, r"args\['cursor'\] must be bytes"),
]


@pytest.mark.parametrize("raw,job_id,message", MALFORMED_JOBS,
                         ids=[m for _, _, m in MALFORMED_JOBS])
def test_malformed_job_raises_a_clear_error(raw, job_id, message):
    with pytest.raises(MalformedJob, match=message) as info:
        decode_job(raw)
    assert info.value.job_id == job_id
    assert isinstance(info.value, ValueError)
    # what a worker does: answer an error result, keep going
    answer = Result.failed(info.value.job_id, str(info.value))
    assert decode_result(encode_result(answer)).error.startswith("malformed job")


def test_unknown_args_pass_through():
    job = Job(1, "store", 0, [b"k"], [0], {"my_tier_option": [1, "x"]})
    assert decode_job(encode_job(job)).args == {"my_tier_option": [1, "x"]}


def _u32(*v):
    return struct.pack(f"<{len(v)}I", *v)


def _f32(*v):
    return struct.pack(f"<{len(v)}f", *v)


def _res(**over):
    fields = dict(v=SCHEMA_VERSION, kind=1, id=7, outcomes=b"\x00\x01", logical=_u32(10, 0),
                  stored=_u32(5, 0), seconds=_f32(0.5, 0.25), codec=0.25, error="", listed=[],
                  more=False, flags=0)
    fields.update(over)
    return _raw(*fields.values())


MALFORMED_RESULTS = [
    (_res(kind=0), "message kind is job, expected result"),
    (_res(v=4), "schema version 4"),
    (_res(v=2), "schema version 2, this process speaks version 3"),
    (_raw(SCHEMA_VERSION, 1, 7, b"", b"", b"", b"", 0.0, "", [], False),
     "11 fields, 12 expected"),
    (_res(outcomes=[0, 1]), "outcomes must be bytes, got list"),
    (_res(outcomes=b"\x09"), "unknown outcome code 9"),
    (_res(outcomes=b"\x07"), "unknown outcome code 7"),
    (_res(logical=[10, 0]), "logical_bytes must be bytes .packed per key., got list"),
    (_res(logical=-5), "logical_bytes must be bytes"),
    (_res(logical=_u32(10)), "logical_bytes holds 4 bytes, expected 8 .4 per key, 2 keys."),
    (_res(stored=1.5), "stored_bytes must be bytes"),
    (_res(stored=_u32(5, 0, 1)), "stored_bytes holds 12 bytes, expected 8"),
    (_res(listed=[b"k"]), "stored_bytes holds 8 bytes, expected 12 .4 per key, 3 keys."),
    (_res(seconds=_f32(0.5)), "seconds holds 4 bytes, expected 8"),
    (_res(seconds=_f32(0.5, -0.25)), "seconds must be >= 0"),
    (_res(seconds=_f32(float("nan"), 0.0)), "seconds must be >= 0"),
    (_res(seconds=[0.5, 0.25]), "seconds must be bytes"),
    (_res(codec=1), "codec_s must be a float >= 0, got int"),
    (_res(codec=-0.1), "codec_s must be a float >= 0"),
    (_res(codec=float("nan")), "codec_s must be a float >= 0"),
    (_res(error=None), "error must be a str, got NoneType"),
    (_res(listed=[1]), "each of listed must be bytes"),
    (_res(more=0), "more must be a bool, got int"),
    (_res(flags=False), "flags must be an int in 0..2..32-1, got bool"),
    (_res(flags=-1), "flags must be an int in 0..2..32-1, got int -1"),
    (_res(flags=2**32), "flags must be an int in 0..2..32-1"),
    (_res(flags=1.0), "flags must be an int in 0..2..32-1, got float"),
]


@pytest.mark.parametrize("raw,message", MALFORMED_RESULTS, ids=[m for _, m in MALFORMED_RESULTS])
def test_malformed_result_raises_a_clear_error(raw, message):
    with pytest.raises(MalformedResult, match=message) as info:
        decode_result(raw)
    assert info.value.job_id == 7


def test_split_keeps_every_key_once_and_each_part_fits():
    keys = [i.to_bytes(2, "big") * 20 for i in range(1000)]
    job = Job(77, "store", 2, keys, list(range(0, 3000, 3)), {"nbytes": 1 << 20, "codec": "auto"})
    ids = itertools.count(1000)
    parts = split_job(job, 1024, ids.__next__)
    assert len(parts) > 40
    assert [p.job_id for p in parts] == list(range(1000, 1000 + len(parts)))
    assert [k for p in parts for k in p.keys] == keys
    assert [r for p in parts for r in p.rows] == job.rows
    for part in parts:
        raw = encode_job(part)
        assert len(raw) <= 1024
        assert decode_job(raw) == part
        assert (part.op, part.tier, part.args) == (job.op, job.tier, job.args)
        assert part.args is not job.args


def test_split_of_a_job_that_fits_returns_it_unchanged():
    job = EXAMPLES[0]
    assert split_job(job, 10_000, itertools.count().__next__) == [job]
    assert split_job(job, 10_000, itertools.count().__next__)[0] is job


def test_split_refuses_what_cannot_fit():
    with pytest.raises(ValueError, match="key 1 .300 bytes. does not fit 200 bytes even alone"):
        split_job(Job(1, "probe", 0, [b"a", b"b" * 300, b"c"]), 200, itertools.count().__next__)
    with pytest.raises(ValueError, match="has no keys to split by"):
        split_job(Job(1, "scan", 0, [], [], {"cursor": b"x" * 500}), 200,
                  itertools.count().__next__)


def test_split_result_of_a_scan_listing():
    keys = [i.to_bytes(4, "big") * 10 for i in range(500)]
    sizes = [1000 + i for i in range(500)]
    result = Result(3, [], [], sizes, [], 0.1, "", keys)
    parts = split_result(result, 512)
    assert all(len(encode_result(p)) <= 512 for p in parts)
    assert [k for p in parts for k in p.listed] == keys
    assert [b for p in parts for b in p.stored_bytes] == sizes  # each key keeps its size
    assert [p.more for p in parts] == [True] * (len(parts) - 1) + [False]
    assert {p.job_id for p in parts} == {3} and parts[0].codec_s == 0.1
    long_error = Result.failed(4, "x" * 5000, 1)
    (short,) = split_result(long_error, 512)
    assert len(encode_result(short)) <= 512 and short.error.endswith("[truncated]")
    assert short.outcomes == [Outcome.ERROR]


def test_split_result_of_many_short_keys_answers_each_key_once_in_order():
    """Per-key figures take 13 bytes a key: a job of short keys that fit one ring slot
    may answer with more; the worker splits the answer, keys in order."""
    n = 1000
    result = Result(5, [Outcome(i % 7) for i in range(n)], list(range(n)),
                    [3 * i for i in range(n)], [i / 1024 for i in range(n)], 0.25, "boom",
                    flags=ResultFlag.NAMESPACE_RESET)
    parts = split_result(result, 1024)
    assert len(parts) > 10 and all(len(encode_result(p)) <= 1024 for p in parts)
    assert [p.more for p in parts] == [True] * (len(parts) - 1) + [False]
    for name in ("outcomes", "logical_bytes", "stored_bytes", "seconds"):
        assert [v for p in parts for v in getattr(p, name)] == getattr(result, name), name
    assert parts[0].error == "boom" and all(not p.error for p in parts[1:])
    assert parts[0].codec_s == 0.25 and all(p.codec_s == 0.0 for p in parts[1:])
    assert parts[0].flags == ResultFlag.NAMESPACE_RESET and all(not p.flags for p in parts[1:])
    assert [decode_result(encode_result(p)) for p in parts] == parts


def test_a_figure_the_wire_cannot_carry_fails_only_its_key():
    """Issue 28 item 4: a per-key figure over 32 bits (a file of 5 GiB named like a
    chunk) failed the whole result at the worker (``'I' format requires ...``): 7 good
    keys of 8 lost with it, a listing retried for ever. Checked at the worker before the
    wire: that key fails alone, a listed key is left out, times are clamped."""
    big = 5 << 30
    n = 8
    answered = Result(21, [Outcome.OK] * n, [4096] * n, [big] + [4200] * (n - 1),
                      [0.125] * (n - 1) + [float("nan")], 0.5, "", flags=1)
    (part,) = split_result(answered, 4096)
    assert part.outcomes == [Outcome.ERROR] + [Outcome.OK] * (n - 1)
    assert part.logical_bytes == [0] + [4096] * (n - 1)
    assert part.stored_bytes == [0] + [4200] * (n - 1)
    assert part.seconds == [0.125] * (n - 1) + [0.0]
    assert "key 0" in part.error and "stored_bytes 5368709120" in part.error
    assert part.flags == 1 and part.codec_s == 0.5
    assert decode_result(encode_result(part)) == part
    listing = Result(22, [], [], [100, big, 300, -1], [], listed=[b"a", b"b", b"c", b"d"])
    parts = split_result(listing, 4096)
    assert [k for p in parts for k in p.listed] == [b"a", b"c"]
    assert [v for p in parts for v in p.stored_bytes] == [100, 300]
    assert all(not p.error for p in parts)  # a listing with an error is listed again
    many = Result(23, [Outcome.OK] * 300, [1] * 300, [big] * 300, [0.0] * 300)
    parts = split_result(many, 512)
    assert [o for p in parts for o in p.outcomes] == [Outcome.ERROR] * 300
    assert "297 more" in parts[0].error
    with pytest.raises(ValueError, match="outcomes must be codes"):  # not a figure: refused
        split_result(Result(24, [99], [0], [0], [0.0]), 4096)


# --- properties ---

keys_st = st.lists(st.binary(max_size=8) | st.binary(max_size=120), max_size=80)
_U32 = st.one_of(st.integers(0, 300), st.sampled_from([255, 256, 65535, 65536, 2**32 - 1]),
                 st.integers(0, 2**32 - 1))
_SECONDS = st.floats(0, 1e6, width=32)  # what float32 carries exactly


@st.composite
def results(draw, keys=st.lists(st.binary(max_size=8), max_size=3), max_answered=40):
    """A valid result: per-key figures for its answered keys, a listing with sizes."""
    outcomes = draw(st.lists(st.sampled_from(list(Outcome)), max_size=max_answered))
    n = len(outcomes)
    listed = draw(keys)
    return Result(draw(st.integers(0, 2**64 - 1)), outcomes,
                  draw(st.lists(_U32, min_size=n, max_size=n)),
                  draw(st.lists(_U32, min_size=n + len(listed), max_size=n + len(listed))),
                  draw(st.lists(_SECONDS, min_size=n, max_size=n)),
                  draw(st.floats(0, 1e6)), draw(st.text(max_size=300)), listed,
                  draw(st.booleans()), draw(st.one_of(st.just(0), _U32)))


@st.composite
def jobs(draw):
    op = draw(st.sampled_from(sorted(OPS)))
    keys = [] if op in ("scan", "stop") else draw(keys_st)
    rows = draw(st.lists(st.integers(0, (1 << 64) - 1), min_size=len(keys),
                         max_size=len(keys))) if op in ("store", "load") else []
    args = draw(st.fixed_dictionaries({}, optional={
        "nbytes": st.integers(0, 1 << 40), "codec": st.sampled_from(["auto", "zstd", "none"]),
        "cursor": st.binary(max_size=20), "x_custom": st.text(max_size=10)}))
    return Job(draw(st.integers(0, (1 << 64) - 1)), op, draw(st.integers(0, 300)), keys, rows,
               args)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=jobs(), fraction=st.floats(0.02, 1.2), first_id=st.integers(0, (1 << 64) - 5000))
def test_split_and_round_trip_property(job, fraction, first_id):
    assert decode_job(encode_job(job)) == job
    max_bytes = max(30, int(len(encode_job(job)) * fraction))
    try:
        parts = split_job(job, max_bytes, itertools.count(first_id).__next__)
    except ValueError:
        # only when a lone key (or a keyless job) really cannot fit a part
        assert len(encode_job(job)) > max_bytes
        worst = Job((1 << 64) - 1, job.op, job.tier, [], [], job.args)
        if job.keys:
            assert any(len(encode_job(Job(first_id + 1000, job.op, job.tier, [k],
                                          [r] if job.rows else [], job.args))) > max_bytes
                       or len(encode_job(worst)) > max_bytes
                       for k, r in zip(job.keys, job.rows or [0] * len(job.keys)))
        return
    assert [k for p in parts for k in p.keys] == job.keys
    assert [r for p in parts for r in p.rows] == job.rows
    if len(parts) > 1:
        assert len({p.job_id for p in parts}) == len(parts)
    for part in parts:
        raw = encode_job(part)
        assert len(raw) <= max_bytes
        assert decode_job(raw) == part


@settings(max_examples=200, deadline=None)
@given(keys=keys_st, max_bytes=st.integers(200, 2000), error=st.text(max_size=300))
def test_split_result_property(keys, max_bytes, error):
    result = Result(5, [Outcome.OK, Outcome.MISS], [1, 0], [2, 0] + [len(k) for k in keys],
                    [0.5, 0.0], 0.25, error, keys)
    try:
        parts = split_result(result, max_bytes)
    except ValueError:
        assert any(len(k) + 60 > max_bytes for k in keys)
        return
    assert [k for p in parts for k in p.listed] == keys
    assert [o for p in parts for o in p.outcomes] == result.outcomes
    assert [b for p in parts for b in p.stored_bytes] == result.stored_bytes
    assert all(len(encode_result(p)) <= max_bytes for p in parts)
    assert all(decode_result(encode_result(p)) == p for p in parts)
    assert [p.more for p in parts][-1] is False


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.binary(max_size=8)
    | st.text(max_size=8) | st.floats(),
    lambda inner: st.lists(inner, max_size=9) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=20)


@st.composite
def near_valid(draw):
    """A valid job or result message with one field (or element of a list field) replaced."""
    if draw(st.booleans()):
        msg = msgpack.unpackb(encode_job(draw(jobs())), strict_map_key=False)
    else:
        msg = msgpack.unpackb(encode_result(draw(results())), strict_map_key=False)
    i = draw(st.integers(0, len(msg) - 1))
    if type(msg[i]) is list and msg[i] and draw(st.booleans()):
        msg[i][draw(st.integers(0, len(msg[i]) - 1))] = draw(values)
    elif type(msg[i]) is dict and msg[i] and draw(st.booleans()):
        msg[i][draw(st.sampled_from(sorted(msg[i])))] = draw(values)
    elif type(msg[i]) is bytes and msg[i] and draw(st.booleans()):
        # one byte of a packed bin changed: an unknown outcome code, a negative or NaN time
        b = bytearray(msg[i])
        b[draw(st.integers(0, len(b) - 1))] = draw(st.sampled_from([0x07, 0x80, 0xff, 0x7f]))
        msg[i] = bytes(b)
    else:
        msg[i] = draw(values)
    return msgpack.packb(msg, use_bin_type=True)


@settings(max_examples=600, deadline=None)
@given(raw=st.one_of(st.binary(max_size=64),
                     values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
                     near_valid()))
def test_decode_raises_only_malformed_and_fast_path_agrees(raw):
    """Garbage never escapes as another exception; what the fast path accepts the
    thorough checks accept, and what it rejects they reject with a precise message."""
    for decode, diagnose in ((decode_job, jobs_mod._diagnose_job),
                             (decode_result, jobs_mod._diagnose_result)):
        try:
            decoded = decode(raw)
        except MalformedJob as exc:
            assert "fast path only" not in str(exc)
        else:
            diagnose(msgpack.unpackb(raw, strict_map_key=False))  # must not raise
            assert type(decoded) in (Job, Result)


def test_split_is_exact_around_array_header_sizes():
    """msgpack array headers grow at 16 elements: sweep every budget around that."""
    for n, rows in ((40, True), (40, False), (20, True)):
        keys = [bytes([i]) for i in range(n)]
        job = Job(1, "store" if rows else "delete", 0, keys, list(range(100, 100 + n)) if rows
                  else [])
        full = len(encode_job(job))
        for max_bytes in range(full - 60, full + 1):
            parts = split_job(job, max_bytes, itertools.count(2).__next__)
            assert [k for p in parts for k in p.keys] == keys
            sizes = [len(encode_job(p)) for p in parts]
            assert max(sizes) <= max_bytes
            # greedy and tight: each part but the last could not take the next key
            for p, nxt in zip(parts, parts[1:]):
                bigger = Job(p.job_id, p.op, p.tier, p.keys + nxt.keys[:1],
                             p.rows + nxt.rows[:1], p.args)
                assert len(encode_job(bigger)) > max_bytes


def test_ring_and_jobs_import_neither_torch_nor_vllm():
    """Tier workers import these modules: they must stay free of torch and vLLM."""
    import subprocess
    import sys

    code = ("import sys, shmtier.shared.ring, shmtier.shared.jobs; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# --- the C encoder of the common job (shmtier.shared._wire.pack_job) ---

_UINTS = st.one_of(st.integers(0, 300), st.sampled_from(
    [127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]), st.integers(0, 2**64 - 1))
_KEYS = st.lists(st.one_of(st.binary(max_size=40), st.binary(min_size=250, max_size=300)),
                 max_size=20)


def _msgpack_job(job_id, code, tier, keys, rows):
    return msgpack.packb([jobs_mod.SCHEMA_VERSION, jobs_mod.KIND_JOB, job_id, code, tier,
                          keys, rows, {}], use_bin_type=True)


@settings(max_examples=300, deadline=None)
@given(_UINTS, st.sampled_from(sorted(jobs_mod.OPS)), st.integers(0, 200), _KEYS,
       st.lists(_UINTS, max_size=20), st.booleans())
def test_c_job_encoding_is_byte_for_byte_msgpack(job_id, op, tier, keys, rows, as_tuples):
    if as_tuples:
        keys, rows = tuple(keys), tuple(rows)
    packed = pack_job(job_id, op, tier, keys, rows)
    assert packed == _msgpack_job(job_id, jobs_mod.OPS[op], tier, list(keys), list(rows))
    rows_fit = len(rows) == len(keys) if op in ("store", "load") else not rows
    if rows_fit and not (keys and op in ("scan", "stop")) and all(r < 2**63 for r in rows):
        job = decode_job(packed)  # a valid job: the worker reads back what was packed
        assert (job.job_id, job.op, job.tier, job.keys, job.rows) == (
            job_id, op, tier, list(keys), list(rows))


def test_c_job_encoding_of_long_arrays_and_keys():
    keys = [bytes([i % 256]) * (70000 if i == 0 else 36) for i in range(70000)]
    rows = list(range(70000))
    assert pack_job(7, "store", 1, keys, rows) == _msgpack_job(7, 1, 1, keys, rows)


@pytest.mark.parametrize("keys, rows", [
    (["text key"], [1]),            # str, not bytes
    ([bytearray(b"k")], [1]),        # not exactly bytes
    ([b"k"], [True]),                # a bool is not a row
    ([b"k"], [-1]),                  # negative
    ([b"k"], [2**64]),               # too large for msgpack
    ([b"k"], [1.5]),                 # not an int
])
def test_c_job_encoding_leaves_other_values_to_msgpack(keys, rows):
    c_says = jobs_mod._pack_job_c(jobs_mod.SCHEMA_VERSION, jobs_mod.KIND_JOB, 1, 1, 0, keys, rows)
    assert c_says is NotImplemented
    try:
        expected = _msgpack_job(1, 1, 0, keys, rows)
    except Exception as exc:  # what msgpack refuses, pack_job refuses the same way
        with pytest.raises(type(exc)):
            pack_job(1, "store", 0, keys, rows)
    else:
        assert pack_job(1, "store", 0, keys, rows) == expected


# --- the C decoder of results (shmtier.shared._wire.decode_result) ---

_C_DECODE = jobs_mod._decode_result_c


def _python_decode_result(raw):
    """decode_result without its C fast path (the reference)."""
    saved, jobs_mod._decode_result_c = jobs_mod._decode_result_c, lambda *a: None
    try:
        return decode_result(raw)
    finally:
        jobs_mod._decode_result_c = saved


@settings(max_examples=400, deadline=None)
@given(results(keys=_KEYS, max_answered=300))
def test_c_result_decoding_reads_back_what_encode_result_wrote(result):
    raw = encode_result(result)
    c = _C_DECODE(raw, SCHEMA_VERSION, jobs_mod.KIND_RESULT, jobs_mod._OUTCOMES, Result)
    assert type(c) is Result
    python = _python_decode_result(raw)
    assert c == python == result
    for name in Result._fields:  # every field, with the same types
        c_value, py_value = getattr(c, name), getattr(python, name)
        assert type(c_value) is type(py_value), name
        if type(c_value) is list:
            assert [type(v) for v in c_value] == [type(v) for v in py_value], name
    assert all(type(o) is Outcome for o in python.outcomes)


def test_c_result_decoding_of_long_bins_and_equal_neighbours():
    n = 70000  # bin32 headers; equal sizes share one int object
    result = Result(1, [Outcome.OK] * n, [1 << 20] * n, [1 << 20] * (n - 1) + [7, 9],
                    [0.5] * n, listed=[b"k"])
    raw = encode_result(result)
    c = _C_DECODE(raw, SCHEMA_VERSION, jobs_mod.KIND_RESULT, jobs_mod._OUTCOMES, Result)
    assert c is not None and c == result == _python_decode_result(raw)


@settings(max_examples=600, deadline=None)
@given(raw=st.one_of(st.binary(max_size=64),
                     values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
                     near_valid()))
def test_c_result_decoding_accepts_only_what_python_accepts_alike(raw):
    c = _C_DECODE(raw, SCHEMA_VERSION, jobs_mod.KIND_RESULT, jobs_mod._OUTCOMES, Result)
    if c is None:
        return  # left to the Python path (covered by the test above this one's neighbour)
    assert c == _python_decode_result(raw)
    assert [type(v) for v in c] == [type(v) for v in _python_decode_result(raw)]


def test_c_result_decoder_builds_only_plain_tuple_subclasses():
    raw = encode_result(Result(1, [Outcome.OK], [1], [2], [0.5]))
    for bad in (list, dict, jobs_mod.Job, 3):
        with pytest.raises(TypeError, match="result_type must be a tuple subclass"):
            _C_DECODE(raw, SCHEMA_VERSION, jobs_mod.KIND_RESULT, jobs_mod._OUTCOMES, bad)
    with pytest.raises(TypeError, match="outcomes must be a tuple"):
        _C_DECODE(raw, SCHEMA_VERSION, jobs_mod.KIND_RESULT, list(Outcome), Result)
    assert _C_DECODE(raw, SCHEMA_VERSION, jobs_mod.KIND_RESULT, jobs_mod._OUTCOMES, tuple) == (
        1, [Outcome.OK], [1], [2], [0.5], 0.0, "", [], False, 0)
