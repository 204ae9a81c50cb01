"""A small Llama and a BPE tokenizer, made locally (no downloads), for the e2e suite.

``make_model(path)`` writes into ``path`` what vLLM needs to serve a model: the
transformers config (``config.json``), random bf16 weights from a fixed seed
(``model.safetensors``), a byte-level BPE tokenizer trained with the ``tokenizers``
library on a generated corpus (``tokenizer.json``) and ``tokenizer_config.json`` with a
chat template. Same inputs, same files: the weights and the tokenizer depend on nothing
but the constants below. Called once per test session (``conftest.model_dir``), in the
pytest process; takes a second or two.

The geometry is the smallest the CPU engine serves: head_dim 32 (vLLM's CPU attention
backend's minimum), 2 layers, a 512-token vocabulary.
"""

from __future__ import annotations

import json
import os
import random

SEED = 1234
VOCAB = 512
HIDDEN = 128
HEADS = 4           # head_dim = HIDDEN // HEADS = 32
KV_HEADS = 2
LAYERS = 2
INTERMEDIATE = 256
MAX_POSITIONS = 4096

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_WORDS = ("the a an of to in on for with as at by from about into over after cache block "
          "token model server engine prefix tier memory disk file shared segment worker "
          "request answer question chat turn user system assistant load store hit miss "
          "copy page row chunk key value layer head attention vector number river stone "
          "cloud garden window letter music yellow green blue quiet rapid gentle ancient "
          "modern simple careful bright dark warm cold north south east west morning "
          "evening story history science travel kitchen bread apple orange lemon paper "
          "pencil table chair mountain valley ocean island forest desert city village "
          "one two three four five six seven eight nine ten hundred thousand").split()


def corpus(n_lines: int = 4000, seed: int = SEED) -> list[str]:
    """Generated training text: random sentences over a fixed word list, digits and
    punctuation (so any prompt the suite writes tokenizes into known merges)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice(".?!,;:"))
    return lines


def make_tokenizer(path: str) -> None:
    """Train the byte-level BPE tokenizer and write tokenizer.json and
    tokenizer_config.json (with the chat template) into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
           "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
           "add_bos_token": False, "model_max_length": MAX_POSITIONS,
           "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def make_model(path: str) -> str:
    """Write the model and tokenizer into ``path`` (created if missing); return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    make_tokenizer(path)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS, max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wider logits than the default init: fewer near-ties in argmax
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    for extra in ("generation_config.json",):  # vLLM would take sampling defaults from it
        try:
            os.remove(os.path.join(path, extra))
        except FileNotFoundError:
            pass
    return path


if __name__ == "__main__":
    import sys
    print(make_model(sys.argv[1]))
