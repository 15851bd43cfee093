"""Tokenize and key a long chat prompt whose first 90% was seen before (the proxy's case).

Figures for the built-in tokenizer and for a byte-level BPE trained on the spot on the
prompts' vocabulary (HF ``tokenizers``, as a model's ``tokenizer.json`` would be, about
one token per word as with a real model's vocabulary), each uncached (whole prompt
tokenized) and cached (``PrefixTokenCache`` holding a prompt with the same first 90%).
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.micro.model_files import write_tiny_model
from bench.micro.report import Figure, median_us_each
from kvcore.keys import block_keys
from kvcore.tokenize import BuiltinTokenizer, HFTokenizer, PrefixTokenCache, Tokenizer

PROMPT_TOKENS = 8192
SEEN_FRACTION = 0.9
VARIANTS = 60
MODEL = "bench-model"


def _sentence(rng: random.Random, words: list[str]) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(6, 16))) + ".\n"


def _text_of(tokenizer: Tokenizer, tokens: int, rng: random.Random, words: list[str]) -> str:
    lines: list[str] = []
    while len(tokenizer.encode("".join(lines), add_special_tokens=False)) < tokens:
        lines.extend(_sentence(rng, words) for _ in range(20))
    return "".join(lines)


def _chat(system: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _words() -> list[str]:
    rng = random.Random(5)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    return ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(3000)]


def _measure(tokenizer: Tokenizer, label: str) -> list[Figure]:
    rng = random.Random(11)
    words = _words()
    system = _text_of(tokenizer, int(PROMPT_TOKENS * SEEN_FRACTION), rng, words)
    tail = int(PROMPT_TOKENS * (1 - SEEN_FRACTION))
    questions = [_text_of(tokenizer, tail, rng, words) for _ in range(VARIANTS)]
    cache = PrefixTokenCache(tokenizer)

    def route(question: str, encode: Callable[..., list[int]]) -> Callable[[], object]:
        def run() -> object:
            text = tokenizer.apply_chat_template(_chat(system, question))
            return block_keys(encode(text, add_special_tokens=False), model=MODEL)

        return run

    cache.encode(tokenizer.apply_chat_template(_chat(system, "warm-up")), add_special_tokens=False)
    warm = median_us_each(route(q, cache.encode) for q in questions)
    cold = median_us_each(route(q, tokenizer.encode) for q in questions[:20])
    floor = median_us_each(partial(tokenizer.encode, q) for q in questions)
    tokens = len(tokenizer.encode(tokenizer.apply_chat_template(_chat(system, questions[0]))))
    return [
        Figure(f"chat {tokens} tok, 90% seen, {label}, cached (p50)", warm / 1000, "ms", 1.0),
        Figure(f"chat {tokens} tok, {label}, uncached (p50)", cold / 1000, "ms"),
        Figure(f"its new 10% alone, {label} encode (p50)", floor / 1000, "ms"),
    ]


def run() -> list[Figure]:
    figures = _measure(BuiltinTokenizer(), "builtin")
    with tempfile.TemporaryDirectory() as scratch:
        corpus = [" ".join(_words()[i : i + 12]) for i in range(0, 3000, 12)]
        model = write_tiny_model(Path(scratch) / "bpe", vocab_size=8000, corpus=corpus)
        figures += _measure(HFTokenizer(model), "HF byte-level BPE")
    return figures
