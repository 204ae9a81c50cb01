"""Conversations, filler prompts and the comparison with the reference server (e2e suite).

Every request is a greedy chat completion (temperature 0, ``max_tokens`` fixed) streamed
with vLLM's ``return_token_ids``, so that :func:`ask` returns the generated token ids
(compared exactly, not the lossy text of a random model's bytes) and the time to the
first token. :class:`Compare` asks the server under test and the reference server (the
same engine flags without ``--kv-transfer-config``; answers memoized per prompt) and
records every difference; a conversation goes on with the reference's answer, so one
difference does not change every later prompt. Prompts are built from the suite's
tokenizer to exact token counts (:class:`Prompts`), so that a prompt covers a known
number of 32-token blocks.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import e2e_model
from .e2e_server import BLOCK_SIZE, SERVED_NAME

MAX_TOKENS = 12


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    ttft_s: float
    prompt_tokens: int
    kv_transfer_params: Any = None


def ask(server, messages: list[dict], max_tokens: int = MAX_TOKENS,
        kv_transfer_params: dict | None = None, timeout_s: float | None = None,
        dp_rank: int | None = None) -> Answer:
    """One greedy chat completion, streamed: its text, token ids, the seconds until the
    first generated token arrived, and the prompt's length in tokens. ``timeout_s``:
    the client's read timeout (openai.APITimeoutError past it); ``dp_rank``: the
    data-parallel replica that serves it (``Server.dp_headers``)."""
    extra: dict[str, Any] = {"return_token_ids": True}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    client = server.client if timeout_s is None else server.client.with_options(
        timeout=timeout_s)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, temperature=0, max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, extra_body=extra,
        extra_headers=server.dp_headers(dp_rank))
    ttft = None
    text, ids, prompt_tokens, params = [], [], 0, None
    for chunk in stream:
        for choice in chunk.choices:
            got = (choice.model_extra or {}).get("token_ids") or []
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            ids += got
            if choice.delta and choice.delta.content:
                text.append(choice.delta.content)
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        params = (chunk.model_extra or {}).get("kv_transfer_params") or params
    return Answer("".join(text), ids, ttft if ttft is not None else float("nan"),
                  prompt_tokens, params)


class Reference:
    """The reference server's answers (a running server), memoized per (messages,
    max_tokens)."""

    def __init__(self, server):
        self.server = server
        self._lock = threading.Lock()
        self._memo: dict[str, Answer] = {}

    def answer(self, messages: list[dict], max_tokens: int = MAX_TOKENS) -> Answer:
        key = json.dumps([messages, max_tokens], sort_keys=True)
        with self._lock:
            hit = self._memo.get(key)
        if hit is None:
            hit = ask(self.server, messages, max_tokens)
            with self._lock:
                self._memo[key] = hit
        return hit


@dataclass
class Compare:
    """Asks a server and the reference the same prompts; ``assert_identical()`` fails
    naming every prompt whose generated token ids differ."""

    reference: Reference
    asked: int = 0
    mismatches: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ask(self, server, messages: list[dict], max_tokens: int = MAX_TOKENS,
            label: str = "", kv_transfer_params: dict | None = None,
            timeout_s: float | None = None, reference_first: bool = True,
            dp_rank: int | None = None) -> Answer:
        """The server's answer (compared with the reference's, asked before it unless
        ``reference_first`` is False; ``dp_rank``: asked of that data-parallel replica);
        the conversation should go on with ``.reference_text`` of the returned answer."""
        ref = self.reference.answer(messages, max_tokens) if reference_first else None
        got = ask(server, messages, max_tokens, kv_transfer_params, timeout_s, dp_rank)
        if ref is None:
            ref = self.reference.answer(messages, max_tokens)
        with self._lock:
            self.asked += 1
            if got.token_ids != ref.token_ids:
                self.mismatches.append(
                    f"{server.name} {label or ''} ({got.prompt_tokens} prompt tokens): "
                    f"{got.token_ids} != reference {ref.token_ids}")
        got.reference_text = ref.text  # type: ignore[attr-defined]
        return got

    def assert_identical(self) -> None:
        assert self.asked, "no request was compared"
        assert not self.mismatches, (f"{len(self.mismatches)} of {self.asked} answers differ "
                                     "from the engine without offloading:\n"
                                     + "\n".join(self.mismatches))


class Prompts:
    """Deterministic prompt text from the suite's tokenizer (``model_dir``), built to a
    token count: ``text(n, seed)`` is ``n`` tokens long (as the tokenizer counts the
    plain text; the chat template adds a few)."""

    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
        self._fillers = 0
        self._lock = threading.Lock()

    def count(self, text: str) -> int:
        return len(self.tok.encode(text).ids)

    def text(self, n_tokens: int, seed: Any) -> str:
        rng = random.Random(f"e2e-{seed}")
        words: list[str] = []
        while True:
            words.append(rng.choice(e2e_model._WORDS))
            text = " ".join(words)
            if self.count(text) >= n_tokens:
                return text

    def system(self, seed: Any = "system", n_tokens: int = 70) -> dict:
        return {"role": "system", "content": self.text(n_tokens, seed)}

    def user(self, seed: Any, n_tokens: int = 40) -> dict:
        return {"role": "user", "content": self.text(n_tokens, seed)}

    def filler(self, blocks: int = 14) -> list[dict]:
        """A new prompt (never asked before in this session) of about ``blocks`` device
        blocks: asking it takes that many blocks of the device cache and of the CPU tier."""
        with self._lock:
            self._fillers += 1
            n = self._fillers
        return [{"role": "user", "content": self.text(blocks * BLOCK_SIZE - 8, f"filler-{n}")}]


@dataclass
class Conversations:
    """``n`` multi-turn chats sharing one system prompt; ``turn(cmp, server)`` asks every
    chat's next user turn at once (one thread per chat), compares the answers and appends
    the reference's answer to each history. ``histories`` holds the messages so far."""

    prompts: Prompts
    n: int
    tag: str
    user_tokens: int = 40
    histories: list[list[dict]] = field(default_factory=list)
    turns: int = 0

    def __post_init__(self):
        system = self.prompts.system(f"{self.tag}-system")
        self.histories = [[system] for _ in range(self.n)]

    def next_messages(self, i: int) -> list[dict]:
        return self.histories[i] + [self.prompts.user(f"{self.tag}-{i}-{self.turns}",
                                                      self.user_tokens)]

    def turn(self, cmp: Compare, server) -> list[Answer]:
        msgs = [self.next_messages(i) for i in range(self.n)]

        def one(i):
            return cmp.ask(server, msgs[i], label=f"{self.tag} chat {i} turn {self.turns}")

        with ThreadPoolExecutor(self.n) as pool:
            answers = list(pool.map(one, range(self.n)))
        for i, a in enumerate(answers):
            self.histories[i] = msgs[i] + [{"role": "assistant", "content": a.reference_text}]
        self.turns += 1
        return answers

    def replay(self, cmp: Compare, server, upto: int | None = None) -> list[Answer]:
        """Ask each chat's last user turn again (its whole history as the prompt, the
        last answer left out): a prompt whose prefix was computed before."""
        def one(i):
            h = self.histories[i][:-1] if upto is None else self.histories[i][:upto]
            return cmp.ask(server, h, label=f"{self.tag} chat {i} replay")

        with ThreadPoolExecutor(self.n) as pool:
            return list(pool.map(one, range(self.n)))


def flush(cmp: Compare, server, prompts: Prompts, blocks: int) -> None:
    """Ask new filler prompts covering at least ``blocks`` device blocks, one at a time
    (so that each evicts the least recently used blocks of the device cache and, as they
    are stored, of the CPU tier). Their answers are compared too."""
    per = 14
    for _ in range(-(-blocks // per)):
        cmp.ask(server, prompts.filler(per), max_tokens=1, label="filler")
