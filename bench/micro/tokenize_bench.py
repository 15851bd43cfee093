"""Tokenize and key a long chat prompt whose first 90% was seen before (the proxy's case).

Figures for the built-in tokenizer and for a byte-level BPE trained on the spot on the
prompts' vocabulary (HF ``tokenizers``, as a model's ``tokenizer.json`` would be, about
one token per word as with a real model's vocabulary), each uncached (whole prompt
rendered, tokenized and keyed) and cached (``PrefixTokenCache.encode_keyed`` holding a
prompt with the same first 90%: only the new tail is tokenized and keyed), beside the
tokenizer's own encode of the new 10% alone; wall and CPU (thread) time, since a machine
shared with other work stretches the first. Then the proxy's whole routing decision for
300 such prompts in CPU time, p50 and p99, and for 300 prompts never seen before.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.micro.decision_inputs import FLEET_MODEL, chat, decision_fleet, hold, text_of, words
from bench.micro.model_files import write_tiny_model
from bench.micro.report import Figure, median_us_each
from dataplane.openai_request import InferenceRequest, parse_inference
from dataplane.routing import Defaults, Router
from kvcore.keys import block_keys, root_key
from kvcore.tokenize import BuiltinTokenizer, HFTokenizer, PrefixTokenCache, Tokenizer
from kvruntime.gc_tuning import tune_gc

PROMPT_TOKENS = 8192
SEEN_FRACTION = 0.9
VARIANTS = 60
DECISIONS = 300
NEW_PROMPT_TOKENS = 2048  # a prompt never seen before: 128 blocks of 16
MODEL = "bench-model"


def _timed(run: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU (thread) time of one call, in microseconds."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    run()
    return (time.perf_counter_ns() - wall) / 1000, (time.thread_time_ns() - cpu) / 1000


def _measure(tokenizer: Tokenizer, label: str) -> list[Figure]:
    rng = random.Random(11)
    vocabulary = words()
    system = text_of(tokenizer, int(PROMPT_TOKENS * SEEN_FRACTION), rng, vocabulary)
    tail = int(PROMPT_TOKENS * (1 - SEEN_FRACTION))
    questions = [text_of(tokenizer, tail, rng, vocabulary) for _ in range(VARIANTS)]
    cache = PrefixTokenCache(tokenizer)
    root = root_key(model=MODEL)

    def cached(question: str) -> Callable[[], object]:
        def run() -> object:
            text = tokenizer.apply_chat_template(chat(system, question))
            return cache.encode_keyed(text, add_special_tokens=False, root=root).keys

        return run

    def uncached(question: str) -> Callable[[], object]:
        def run() -> object:
            text = tokenizer.apply_chat_template(chat(system, question))
            return block_keys(tokenizer.encode(text, add_special_tokens=False), model=MODEL)

        return run

    cached("warm-up")()
    # each question's own encode runs just before its cached route, so that other work
    # on the machine weighs on both alike
    pairs = [(_timed(partial(tokenizer.encode, q, add_special_tokens=False)), _timed(cached(q)))
             for q in questions]  # fmt: skip
    cold = median_us_each(uncached(q) for q in questions[:20])
    (floor_wall, floor_cpu), (warm_wall, warm_cpu) = (
        [statistics.median(x) for x in zip(*side, strict=True)] for side in zip(*pairs, strict=True)
    )
    tokens = len(tokenizer.encode(tokenizer.apply_chat_template(chat(system, questions[0]))))
    target = 1.0 if label == "builtin" else None  # an HF BPE's target is relative to its tail
    name = f"chat {tokens} tok, 90% seen, {label}"
    figures = [
        Figure(f"{name}, cached: render + tokenize + key (p50)", warm_wall / 1000, "ms", target),
        Figure("  its CPU time (p50)", warm_cpu / 1000, "ms"),
        Figure(f"{name}, uncached (p50)", cold / 1000, "ms"),
        Figure(f"its new 10% alone, {label} encode (p50)", floor_wall / 1000, "ms"),
        Figure("  its CPU time (p50)", floor_cpu / 1000, "ms"),
    ]
    if label != "builtin":
        over = (warm_cpu - floor_cpu) / 1000
        figures.append(Figure("  cached above the new 10% alone (CPU p50)", over, "ms", 0.3))
    return figures


def _decisions_cpu(count: int = DECISIONS, *, new_prompts: bool = False) -> list[Figure]:
    """The proxy's whole routing decision (``Router.prepare`` + ``choose``, ``kv_aware``,
    64 replicas, built-in tokenizer) for ``count`` prompts, each with a new 10% (or, with
    ``new_prompts``, each of ``NEW_PROMPT_TOKENS`` never seen before: every block
    tokenized, keyed and looked up): CPU time over enough samples for a p99 that is not
    the slowest of a few (``bench.proxy``'s decision figures are wall time over 79)."""
    tokenizer, rng, vocabulary = BuiltinTokenizer(), random.Random(11), words()
    if new_prompts:
        system, tail = "You are a helpful assistant.", NEW_PROMPT_TOKENS
    else:
        system = text_of(tokenizer, int(PROMPT_TOKENS * SEEN_FRACTION), rng, vocabulary)
        tail = int(PROMPT_TOKENS * (1 - SEEN_FRACTION))
    questions = ["warm-up", *(text_of(tokenizer, tail, rng, vocabulary) for _ in range(count))]
    fleet = decision_fleet("builtin", 16)
    router = Router(fleet, Defaults(), random.Random(3))

    def decide(request: InferenceRequest) -> Any:
        prepared = router.prepare(request, path="/v1/chat/completions", headers={},
                                  api_key=None, request_id="bench")  # fmt: skip
        return router.choose(prepared, now=time.monotonic()), prepared

    requests = [
        parse_inference(json.dumps({"model": FLEET_MODEL, "messages": chat(system, q)}).encode(),
                        "chat")
        for q in questions
    ]  # fmt: skip
    if new_prompts:  # residency to look up, none of it these prompts'
        for ordinal in range(8):
            hold(fleet, ordinal, [rng.getrandbits(63) for _ in range(4096)], 2 + ordinal)
    else:
        _, first = decide(requests[0])
        hold(fleet, 7, first.block_keys[: int(len(first.block_keys) * SEEN_FRACTION)])
    decide(requests[0])
    thresholds = gc.get_threshold()
    tune_gc()  # as kvroute-proxy's workers run
    before = _collections()
    cpu = sorted(_timed(partial(decide, request))[1] / 1000 for request in requests[1:])
    collections = _collections() - before
    gc.set_threshold(*thresholds)
    prompts = f"new {NEW_PROMPT_TOKENS}-token chats" if new_prompts else "chats 90% seen"
    name = f"routing decision, {count} {prompts}, 64 replicas, kv_aware, builtin: CPU"
    p50_target, p99_target = (None, None) if new_prompts else (1.0, 3.0)
    return [
        Figure(f"{name} (p50)", statistics.median(cpu), "ms", p50_target),
        Figure(f"{name} (p99)", cpu[int(len(cpu) * 0.99)], "ms", p99_target),
        Figure("  garbage collections during them", collections, "runs"),
    ]


def _collections() -> int:
    return sum(generation["collections"] for generation in gc.get_stats())


def run() -> list[Figure]:
    figures = _measure(BuiltinTokenizer(), "builtin") + _decisions_cpu()
    figures += _decisions_cpu(new_prompts=True)
    with tempfile.TemporaryDirectory() as scratch:
        corpus = [" ".join(words()[i : i + 12]) for i in range(0, 3000, 12)]
        model = write_tiny_model(Path(scratch) / "bpe", vocab_size=8000, corpus=corpus)
        figures += _measure(HFTokenizer(model), "HF byte-level BPE")
    return figures
