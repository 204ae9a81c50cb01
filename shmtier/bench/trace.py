#!/usr/bin/env python
"""Multi-turn chat trace for the tiering benchmarks (deterministic by seed).

Run from a checkout to see what a trace looks like::

    .venv/bin/python -m shmtier.bench.trace                        # default trace, summary
    .venv/bin/python -m shmtier.bench.trace --conversations 400 --requests 1200 --capacity 384
    .venv/bin/python -m shmtier.bench.trace --dump 10              # also print the first 10 requests

Use from a bench::

    from shmtier.bench.trace import TraceParams, make_trace
    trace = make_trace(TraceParams(conversations=300, requests=900, seed=1))
    for req in trace.requests: ...                # sorted by arrival_step

The model (all sizes in chunks; a chunk is one offloaded unit, its byte size is
the driver's business):

* ``conversations`` popularity slots, each running one conversation at a time;
  slot popularity is Zipf(``zipf``) over a shuffled rank. Every conversation
  starts with one of ``system_prompts`` shared system prompts of
  ``system_prompt_chunks`` chunks, so head chunks are shared across conversations.
* A conversation has a final length drawn from ``conv_chunks`` (inclusive). Its
  first turn is the system prompt plus ``first_turn_chunks`` chunks; every later
  turn appends ``turn_chunks`` chunks (the previous answer and the new user
  message). A pick of a slot whose conversation is at its final length starts a
  new conversation there (new id, new keys): the user opens a new chat, so the
  working set keeps growing with the trace.
* Each request = the next turn of a Zipf-picked slot; ``keys`` is the whole
  prefix after that turn (head first), ``new_chunks`` how many chunks the turn
  appended.
* Arrivals: Poisson, ``arrival_rate`` requests per engine step. A user cannot
  send the next turn before reading the answer: after a turn a slot is busy for a
  think time drawn from ``think_steps``; the Zipf pick is redrawn (up to
  PICK_TRIES times) while it hits a busy slot, else the least busy one waits. So
  a turn usually finds its previous turn's chunks stored, and the trace lasts
  about requests / arrival_rate steps. The list is sorted by arrival step (ties
  keep generation order, so one conversation's turns stay in order).
* ``gpu_cached``: with probability ``gpu_cache_prob`` the GPU prefix cache holds the
  system prompt, so the connector's lookup scan starts after it.
* ``decode_steps``: steps a request keeps running after its last chunk was offered.

Keys are 32 random bytes + a 4-byte big-endian group index 0 (vLLM's OffloadKey
layout), so they work for shmtier and for vLLM's file mapper alike.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field

GROUP_SUFFIX = (0).to_bytes(4, "big")
PICK_TRIES = 16


@dataclass(frozen=True)
class TraceParams:
    conversations: int = 300
    requests: int = 900
    zipf: float = 1.0
    system_prompts: int = 8
    system_prompt_chunks: int = 2
    conv_chunks: tuple[int, int] = (8, 32)
    first_turn_chunks: tuple[int, int] = (2, 6)
    turn_chunks: tuple[int, int] = (1, 5)
    arrival_rate: float = 1.0  # requests per step (Poisson)
    think_steps: tuple[int, int] = (20, 80)
    gpu_cache_prob: float = 0.5
    decode_steps: tuple[int, int] = (2, 8)
    seed: int = 1234


@dataclass(frozen=True, slots=True)
class TraceRequest:
    idx: int  # position in the trace (arrival order)
    conv: int  # conversation id
    turn: int  # 0 = first turn
    arrival_step: int
    keys: tuple  # whole prefix after this turn, head first
    new_chunks: int  # chunks this turn appended
    gpu_cached: int  # leading chunks held by the GPU prefix cache
    decode_steps: int


@dataclass
class Trace:
    params: TraceParams
    requests: list
    distinct_keys: int
    conversations_used: int
    last_arrival_step: int
    key_refs: int = field(default=0)  # sum of prefix lengths over requests
    kind: str = "chat"  # the generator ("chat", "docqa", "agent") or "file"

    def describe(self, capacity_chunks: int | None = None) -> str:
        p = self.params
        if not isinstance(p, TraceParams):
            return describe_any(self, capacity_chunks)
        lens = sorted(len(r.keys) for r in self.requests)
        turns = sorted(r.turn for r in self.requests)
        text = (f"{len(self.requests)} requests, {self.conversations_used} conversations in "
                f"{p.conversations} Zipf({p.zipf}) popularity slots (seed {p.seed}), "
                f"prefix {lens[0]}-{lens[-1]} chunks (median {lens[len(lens) // 2]}), "
                f"turn index median {turns[len(turns) // 2]} max {turns[-1]}, "
                f"{self.distinct_keys} distinct chunks, "
                f"arrivals over {self.last_arrival_step + 1} steps "
                f"({p.arrival_rate:g}/step, think {p.think_steps[0]}-{p.think_steps[1]} steps)")
        if capacity_chunks:
            text += (f"; working set {self.distinct_keys / capacity_chunks:.1f}x the CPU tier "
                     f"({capacity_chunks} chunks)")
        return text

    def round_robin(self, n: int, rank: int) -> Trace:
        """Replica ``rank``'s share when a router sends each request of this trace to the
        next of ``n`` replicas in turn: requests ``rank``, ``rank + n``, ... (their arrival
        steps and ids kept). ValueError if the share would be empty."""
        if not 0 <= rank < n or rank >= len(self.requests):
            raise ValueError(f"rank {rank} of {n} replicas: expected 0 <= rank < n and at "
                             f"least n requests (the trace has {len(self.requests)})")
        return _trace_of(self.params, self.requests[rank::n], self.kind)

    def summary(self) -> dict:
        lens = [len(r.keys) for r in self.requests]
        return {
            "kind": getattr(self, "kind", "chat"),
            "params": asdict(self.params) if hasattr(self.params, "__dataclass_fields__")
            else dict(self.params or {}),
            "requests": len(self.requests),
            "conversations_used": self.conversations_used,
            "distinct_keys": self.distinct_keys,
            "key_refs": self.key_refs,
            "prefix_median": statistics.median(lens),
            "prefix_max": max(lens),
            "last_arrival_step": self.last_arrival_step,
        }


def make_trace(params: TraceParams | None = None) -> Trace:
    """Generate the trace for ``params`` (same params, same trace, on any machine)."""
    p = params or TraceParams()
    if p.conversations < 1 or p.requests < 1:
        raise ValueError("conversations and requests must be >= 1")
    if p.conv_chunks[0] < p.system_prompt_chunks + 1:
        raise ValueError("conv_chunks must leave room for at least one chunk after the prompt")
    rng = random.Random(p.seed)

    def new_key() -> bytes:
        return rng.randbytes(32) + GROUP_SUFFIX

    prompts = [[new_key() for _ in range(p.system_prompt_chunks)] for _ in range(p.system_prompts)]
    # per popularity slot: the conversation now running in it (a finished one is
    # replaced by a new conversation: the user starts a new chat)
    conv_id = list(range(p.conversations))
    next_conv = p.conversations
    final_len = [rng.randint(*p.conv_chunks) for _ in range(p.conversations)]
    keys_of = [list(prompts[rng.randrange(p.system_prompts)]) for _ in range(p.conversations)]
    length = [0] * p.conversations  # current prefix length (0 = not started)
    turn = [0] * p.conversations
    ready_at = [0] * p.conversations  # earliest step of the slot's next turn (think time)

    rank_to_slot = list(range(p.conversations))
    rng.shuffle(rank_to_slot)
    cum, total = [], 0.0
    for rank in range(p.conversations):
        total += 1.0 / (rank + 1) ** p.zipf
        cum.append(total)

    def pick() -> int:
        return rank_to_slot[bisect.bisect_left(cum, rng.random() * total)]

    raw = []
    clock = 0.0
    for gen_idx in range(p.requests):
        clock += rng.expovariate(p.arrival_rate) if p.arrival_rate > 0 else 0.0
        now = int(clock)
        slot, arrival = _ready_slot(pick, ready_at, now)
        cur = length[slot]
        if cur >= final_len[slot]:  # finished: a new conversation takes the slot
            conv_id[slot] = next_conv
            next_conv += 1
            final_len[slot] = rng.randint(*p.conv_chunks)
            keys_of[slot] = list(prompts[rng.randrange(p.system_prompts)])
            turn[slot] = 0
            cur = 0
        if cur == 0:
            new = min(final_len[slot], p.system_prompt_chunks + rng.randint(*p.first_turn_chunks))
        else:
            new = min(final_len[slot], cur + rng.randint(*p.turn_chunks))
        keys = keys_of[slot]
        while len(keys) < new:
            keys.append(new_key())
        ready_at[slot] = arrival + rng.randint(*p.think_steps)
        raw.append((arrival, gen_idx, conv_id[slot], turn[slot], tuple(keys[:new]), new - cur,
                    p.system_prompt_chunks if rng.random() < p.gpu_cache_prob else 0,
                    rng.randint(*p.decode_steps)))
        length[slot] = new
        turn[slot] += 1
    raw.sort(key=lambda r: (r[0], r[1]))
    requests = [TraceRequest(i, conv, t, arrival, keys, new, gpu, dec)
                for i, (arrival, _, conv, t, keys, new, gpu, dec) in enumerate(raw)]
    distinct = len({k for r in requests for k in r.keys})
    return Trace(p, requests, distinct, len({r.conv for r in requests}), requests[-1].arrival_step,
                 sum(len(r.keys) for r in requests))



# --------------------------------------------------------------------------- other workloads


def _ready_slot(pick, ready_at: list, now: int) -> tuple[int, int]:
    """A Zipf pick (``pick()``) among the slots whose user is not still thinking (a user
    cannot send the next turn before reading the answer); after PICK_TRIES busy picks the
    least busy of them waits. Returns the slot and its request's arrival step."""
    tries = [pick() for _ in range(PICK_TRIES)]
    slot = next((s for s in tries if ready_at[s] <= now), None)
    if slot is None:
        slot = min(tries, key=lambda s: ready_at[s])
    return slot, max(now, ready_at[slot])


def _zipf_picker(rng: random.Random, n: int, zipf: float):
    """A function drawing 0..n-1 with Zipf(``zipf``) popularity over a shuffled rank."""
    rank_to_item = list(range(n))
    rng.shuffle(rank_to_item)
    cum, total = [], 0.0
    for rank in range(n):
        total += 1.0 / (rank + 1) ** zipf
        cum.append(total)
    return lambda: rank_to_item[min(n - 1, bisect.bisect_left(cum, rng.random() * total))]


def _finish(params, raw: list, kind: str) -> Trace:
    """``raw``: (arrival, generation index, group, turn, keys, new, gpu_cached, decode)."""
    raw.sort(key=lambda r: (r[0], r[1]))
    requests = [TraceRequest(i, conv, t, arrival, keys, new, gpu, dec)
                for i, (arrival, _, conv, t, keys, new, gpu, dec) in enumerate(raw)]
    return _trace_of(params, requests, kind)


def _trace_of(params, requests: list, kind: str) -> Trace:
    distinct = len({k for r in requests for k in r.keys})
    return Trace(params, requests, distinct, len({r.conv for r in requests}),
                 requests[-1].arrival_step, sum(len(r.keys) for r in requests), kind)


@dataclass(frozen=True)
class DocQAParams:
    """Long-document QA with many readers: ``documents`` long shared prefixes
    (``doc_chunks``), Zipf-popular; each request is one reader's question about one
    document: the whole document, then ``question_chunks`` new chunks of its own. With
    probability ``gpu_cache_prob`` the GPU prefix cache still holds part of the document
    (up to half of it)."""

    documents: int = 40
    requests: int = 600
    zipf: float = 1.1
    doc_chunks: tuple[int, int] = (24, 96)
    question_chunks: tuple[int, int] = (1, 3)
    arrival_rate: float = 1.0
    gpu_cache_prob: float = 0.2
    decode_steps: tuple[int, int] = (2, 8)
    seed: int = 1234


def make_docqa(params: DocQAParams | None = None) -> Trace:
    p = params or DocQAParams()
    rng = random.Random(p.seed)

    def new_key() -> bytes:
        return rng.randbytes(32) + GROUP_SUFFIX

    docs = [[new_key() for _ in range(rng.randint(*p.doc_chunks))] for _ in range(p.documents)]
    pick = _zipf_picker(rng, p.documents, p.zipf)
    raw, clock, readers = [], 0.0, [0] * p.documents
    for gen_idx in range(p.requests):
        clock += rng.expovariate(p.arrival_rate) if p.arrival_rate > 0 else 0.0
        d = pick()
        q = rng.randint(*p.question_chunks)
        keys = tuple(docs[d]) + tuple(new_key() for _ in range(q))
        gpu = rng.randint(0, len(docs[d]) // 2) if rng.random() < p.gpu_cache_prob else 0
        raw.append((int(clock), gen_idx, d, readers[d], keys, q, gpu, rng.randint(*p.decode_steps)))
        readers[d] += 1
    return _finish(p, raw, "docqa")


@dataclass(frozen=True)
class AgentParams:
    """Agentic loops with branching: ``sessions`` Zipf-popular agent slots, each a tree
    of trajectories starting with one of ``tools`` shared tool-spec prompts
    (``prompt_chunks``). A request is the session's next step: a trajectory (the latest
    with probability ``latest_prob``, else a random one) grows by ``step_chunks`` (the
    tool output and the next call); with probability ``branch_prob`` it forks first, cut
    at a random point after the prompt (retry, backtrack, parallel sub-agent). A
    trajectory past ``max_chunks`` ends the session: a new one takes the slot. After a
    step a session waits ``think_steps`` (the tool runs)."""

    sessions: int = 60
    requests: int = 800
    zipf: float = 1.0
    tools: int = 4
    prompt_chunks: int = 4
    step_chunks: tuple[int, int] = (1, 4)
    max_chunks: int = 64
    branch_prob: float = 0.15
    latest_prob: float = 0.7
    arrival_rate: float = 1.0
    think_steps: tuple[int, int] = (2, 10)
    gpu_cache_prob: float = 0.5
    decode_steps: tuple[int, int] = (1, 4)
    seed: int = 1234


def make_agent(params: AgentParams | None = None) -> Trace:
    p = params or AgentParams()
    rng = random.Random(p.seed)

    def new_key() -> bytes:
        return rng.randbytes(32) + GROUP_SUFFIX

    prompts = [[new_key() for _ in range(p.prompt_chunks)] for _ in range(p.tools)]
    pick = _zipf_picker(rng, p.sessions, p.zipf)
    session_id = list(range(p.sessions))
    next_session = p.sessions
    branches = [[] for _ in range(p.sessions)]  # per slot: trajectories (key lists)
    steps = [0] * p.sessions
    ready_at = [0] * p.sessions
    raw, clock = [], 0.0
    for gen_idx in range(p.requests):
        clock += rng.expovariate(p.arrival_rate) if p.arrival_rate > 0 else 0.0
        now = int(clock)
        slot, arrival = _ready_slot(pick, ready_at, now)
        trajs = branches[slot]
        if not trajs or all(len(t) >= p.max_chunks for t in trajs):
            if trajs:  # the session ended: a new one takes the slot
                session_id[slot] = next_session
                next_session += 1
            trajs[:] = [list(prompts[rng.randrange(p.tools)])]
            steps[slot] = 0
        live = [t for t in trajs if len(t) < p.max_chunks]
        traj = live[-1] if rng.random() < p.latest_prob else live[rng.randrange(len(live))]
        if steps[slot] and rng.random() < p.branch_prob and len(traj) > p.prompt_chunks:
            traj = traj[:rng.randint(p.prompt_chunks, len(traj))]
            trajs.append(traj)
        add = min(rng.randint(*p.step_chunks), p.max_chunks - len(traj))
        add = max(add, 1)
        traj.extend(new_key() for _ in range(add))
        gpu = p.prompt_chunks if rng.random() < p.gpu_cache_prob else 0
        gpu = min(gpu, len(traj) - 1)
        raw.append((arrival, gen_idx, session_id[slot], steps[slot], tuple(traj), add, gpu,
                    rng.randint(*p.decode_steps)))
        steps[slot] += 1
        ready_at[slot] = arrival + rng.randint(*p.think_steps)
    return _finish(p, raw, "agent")


GENERATORS = {"chat": (TraceParams, make_trace), "docqa": (DocQAParams, make_docqa),
              "agent": (AgentParams, make_agent)}
# sizes: (requests, popularity slots) per generator; soak: tens of minutes per run pair
SIZES = {
    "quick": {"chat": dict(conversations=40, requests=120, think_steps=(5, 20)),
              "docqa": dict(documents=8, requests=120, doc_chunks=(8, 24)),
              "agent": dict(sessions=12, requests=120, max_chunks=24)},
    "default": {"chat": {}, "docqa": {}, "agent": {}},
    "soak": {"chat": dict(conversations=3000, requests=60_000),
             "docqa": dict(documents=600, requests=60_000),
             "agent": dict(sessions=1200, requests=60_000)},
    # issue 29's long run, chat only: 600 requests over ~23,700 steps (~2 min at LONG_RUN's
    # 5 ms), long conversations (40-200 chunks, 6-22 a turn) in 50 slots: 8082 distinct
    # chunks, 10.9 GiB at LONG_RUN's 1408 KiB, 10.9x its 1 GiB CPU tier
    "long": {"chat": dict(conversations=50, requests=600, conv_chunks=(40, 200),
                          first_turn_chunks=(8, 24), turn_chunks=(6, 22), arrival_rate=0.025)},
}
#: what ``--long`` (``shmtier bench``, bench/tiering_steps.py) runs the "long" trace with:
#: docs/design.md §10's chunk and CPU tier, the bench's 5 ms step (bench/README.md, "Cost
#: per byte over a long run")
LONG_RUN = {"chunk_kib": 1408, "cpu_mib": 1024, "step_ms": 5.0}


def generate(kind: str, size: str = "default", seed: int = 1234, **overrides) -> Trace:
    """A seeded trace of generator ``kind`` at ``size`` (quick, default, soak; long: chat
    only, ValueError for another ``kind``)."""
    cls, make = GENERATORS[kind]
    if kind not in SIZES[size]:
        raise ValueError(f"size {size!r} is a {' or '.join(SIZES[size])} trace, not {kind!r}")
    kw = dict(SIZES[size][kind])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return make(cls(seed=seed, **kw))


def describe_any(trace: Trace, capacity_chunks: int | None = None) -> str:
    lens = sorted(len(r.keys) for r in trace.requests)
    p = trace.params
    seed = getattr(p, "seed", None)
    text = (f"{trace.kind} trace: {len(trace.requests)} requests in {trace.conversations_used} "
            f"groups{f' (seed {seed})' if seed is not None else ''}, prefix {lens[0]}-{lens[-1]} "
            f"chunks (median {lens[len(lens) // 2]}), {trace.distinct_keys} distinct chunks, "
            f"arrivals over {trace.last_arrival_step + 1} steps")
    if capacity_chunks:
        text += (f"; working set {trace.distinct_keys / capacity_chunks:.1f}x the CPU tier "
                 f"({capacity_chunks} chunks)")
    return text


# --------------------------------------------------------------------------- JSON lines

TRACE_FORMAT = 1


def _key_text(key: bytes) -> str:
    return key.hex()


def key_of(value) -> bytes:
    """A trace file's key as a 36-byte offload key: 72 hex digits are the key itself
    (32-byte hash + 4-byte group, vLLM's OffloadKey layout); any other string or an int
    (a token-block hash from another system) is hashed to 32 bytes + group 0."""
    if isinstance(value, str) and len(value) == 72:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return hashlib.blake2b(str(value).encode(), digest_size=32).digest() + GROUP_SUFFIX
    raise ValueError(f"a key must be a string or an integer, not {type(value).__name__}")


def write_jsonl(trace: Trace, path) -> None:
    """``trace`` as JSON lines: a header line, then one request per line (see
    ``read_jsonl`` for the schema)."""
    params = (asdict(trace.params) if hasattr(trace.params, "__dataclass_fields__")
              else dict(trace.params or {}))
    with open(path, "w") as f:
        f.write(json.dumps({"shmtier_trace": TRACE_FORMAT, "kind": trace.kind,
                            "params": params}) + "\n")
        for r in trace.requests:
            f.write(json.dumps({
                "id": r.idx, "arrival_step": r.arrival_step,
                "keys": [_key_text(k) for k in r.keys], "prompt_chunks": len(r.keys),
                "new_chunks": r.new_chunks, "gpu_cached": r.gpu_cached,
                "output_steps": r.decode_steps, "group": r.conv, "turn": r.turn},
                separators=(",", ":")) + "\n")


def read_jsonl(path) -> Trace:
    """A trace from JSON lines. Schema (one JSON object per line; blank lines and lines
    starting with ``#`` are skipped):

    * optional header: ``{"shmtier_trace": 1, "kind": ..., "params": {...}}``;
    * a request: ``arrival_step`` (int >= 0, the engine step it arrives at; required),
      ``keys`` (its prompt's chunk keys in order, head first, each a 72-hex-digit offload
      key or any other string / integer block hash; required, >= 1),
      ``gpu_cached`` (leading chunks the GPU prefix cache holds, default 0, < len(keys)),
      ``output_steps`` (engine steps it decodes after its last chunk, default 1; alias
      ``decode_steps``), ``id``, ``group`` (conversation / document / session),
      ``turn``, ``new_chunks`` (chunks this request appended; default all),
      ``prompt_chunks`` (if present, must equal len(keys)).

    Requests are replayed in arrival order (ties keep file order)."""
    requests = []
    header = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if "shmtier_trace" in obj:
                if obj["shmtier_trace"] != TRACE_FORMAT:
                    raise ValueError(f"{path}:{lineno}: trace format {obj['shmtier_trace']} "
                                     f"(this shmtier reads {TRACE_FORMAT})")
                header = obj
                continue
            try:
                keys = tuple(key_of(k) for k in obj["keys"])
                arrival = int(obj["arrival_step"])
                gpu = int(obj.get("gpu_cached", 0))
                out = int(obj.get("output_steps", obj.get("decode_steps", 1)))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: bad request: {e!r}") from None
            if not keys or arrival < 0 or not 0 <= gpu < len(keys) or out < 0:
                raise ValueError(f"{path}:{lineno}: need >= 1 key, arrival_step >= 0, "
                                 f"0 <= gpu_cached < len(keys), output_steps >= 0")
            if "prompt_chunks" in obj and int(obj["prompt_chunks"]) != len(keys):
                raise ValueError(f"{path}:{lineno}: prompt_chunks {obj['prompt_chunks']} "
                                 f"but {len(keys)} keys")
            requests.append((arrival, len(requests), obj.get("group", len(requests)),
                             int(obj.get("turn", 0)), keys,
                             int(obj.get("new_chunks", len(keys))), gpu, out))
    if not requests:
        raise ValueError(f"{path}: no requests")
    trace = _finish(header.get("params") or {}, requests, header.get("kind", "file"))
    trace.kind = "file:" + header.get("kind", "?") if header else "file"
    return trace


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Generate, summarise and write a bench trace.")
    ap.add_argument("--kind", default="chat", choices=tuple(GENERATORS))
    ap.add_argument("--size", default="default", choices=tuple(SIZES))
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--zipf", type=float, default=None)
    ap.add_argument("--arrival-rate", type=float, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--read", metavar="FILE", help="read a JSON-lines trace instead")
    ap.add_argument("--write", metavar="FILE", help="write the trace as JSON lines")
    ap.add_argument("--capacity", type=int, default=None,
                    help="CPU tier capacity in chunks, to print the working-set ratio")
    ap.add_argument("--dump", type=int, default=0, help="print the first N requests")
    args = ap.parse_args(argv)
    if args.read:
        trace = read_jsonl(args.read)
    else:
        trace = generate(args.kind, args.size, args.seed, requests=args.requests, zipf=args.zipf,
                         arrival_rate=args.arrival_rate)
    print(trace.describe(args.capacity))
    for r in trace.requests[:args.dump]:
        print(f"  #{r.idx} step {r.arrival_step} group {r.conv} turn {r.turn}: {len(r.keys)} chunks "
              f"(+{r.new_chunks}), gpu_cached {r.gpu_cached}, decode {r.decode_steps}, "
              f"head {r.keys[0][:4].hex()} tail {r.keys[-1][:4].hex()}")
    if args.write:
        write_jsonl(trace, args.write)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
