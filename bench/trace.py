#!/usr/bin/env python
"""Multi-turn chat trace for the tiering benchmarks (deterministic by seed).

Run from a checkout to see what a trace looks like::

    .venv/bin/python bench/trace.py                        # default trace, summary
    .venv/bin/python bench/trace.py --conversations 400 --requests 1200 --capacity 384
    .venv/bin/python bench/trace.py --dump 10              # also print the first 10 requests

Use from a bench::

    from trace import TraceParams, make_trace    # bench/ is on sys.path when run from bench/
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

    def describe(self, capacity_chunks: int | None = None) -> str:
        p = self.params
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

    def summary(self) -> dict:
        lens = [len(r.keys) for r in self.requests]
        return {
            "params": asdict(self.params),
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
        # Zipf pick among conversations whose user is not still thinking (a user
        # cannot send the next turn before reading the answer); after
        # PICK_TRIES busy picks, the least busy of them waits.
        tries = [pick() for _ in range(PICK_TRIES)]
        slot = next((s for s in tries if ready_at[s] <= now), None)
        if slot is None:
            slot = min(tries, key=lambda s: ready_at[s])
        arrival = max(now, ready_at[slot])
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


def main(argv=None) -> int:
    d = TraceParams()
    ap = argparse.ArgumentParser(description="Generate and summarise a multi-turn chat trace.")
    ap.add_argument("--conversations", type=int, default=d.conversations)
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--zipf", type=float, default=d.zipf)
    ap.add_argument("--arrival-rate", type=float, default=d.arrival_rate)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--capacity", type=int, default=None,
                    help="CPU tier capacity in chunks, to print the working-set ratio")
    ap.add_argument("--dump", type=int, default=0, help="print the first N requests")
    args = ap.parse_args(argv)
    trace = make_trace(TraceParams(conversations=args.conversations, requests=args.requests,
                                   zipf=args.zipf, arrival_rate=args.arrival_rate, seed=args.seed))
    print(trace.describe(args.capacity))
    for r in trace.requests[:args.dump]:
        print(f"  #{r.idx} step {r.arrival_step} conv {r.conv} turn {r.turn}: {len(r.keys)} chunks "
              f"(+{r.new_chunks}), gpu_cached {r.gpu_cached}, decode {r.decode_steps}, "
              f"head {r.keys[0][:4].hex()} tail {r.keys[-1][:4].hex()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
