"""Block keys of a long prompt: the proxy computes them for every request."""

from __future__ import annotations

import random

from bench.micro.report import Figure, median_us
from kvcore.keys import block_keys

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def run() -> list[Figure]:
    rng = random.Random(7)
    tokens = [rng.randrange(128_000) for _ in range(8192)]
    us = median_us(lambda: block_keys(tokens, model=MODEL), repeat=100)
    return [Figure("block_keys, 8,192 tokens (median)", us / 1000, "ms", 0.3)]
