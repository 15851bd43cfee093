"""Residency index: prompt lookup time and memory per resident key."""

from __future__ import annotations

import gc
import random
import time
import tracemalloc

from bench.micro.report import Figure, median_us
from kvcore.index import BitmaskResidencyIndex

REPLICAS = 64
PROMPT_KEYS = 512
RESIDENT_KEYS = 1_000_000
FIRSTS = 200  # prompts differing in their first key: each looked up once per round


def _lookup_figures() -> list[Figure]:
    """A prompt looked up for the first time (each lookup another of ``FIRSTS`` prompts
    that differ in their first key only, so the index has no beginning of theirs to
    start from), and one starting with a beginning looked up before (the same prompt)."""
    rng = random.Random(3)
    index = BitmaskResidencyIndex()
    prompt = [rng.getrandbits(64) for _ in range(PROMPT_KEYS)]
    firsts = [rng.getrandbits(64) for _ in range(FIRSTS)]
    for replica in range(REPLICAS):
        run = PROMPT_KEYS if replica % 4 == 0 else rng.randrange(PROMPT_KEYS)
        index.add(replica, prompt[:run])
        if run:
            index.add(replica, firsts)
    index.add(0, (rng.getrandbits(64) for _ in range(100_000)))
    prompts = [[first, *prompt[1:]] for first in firsts]
    turn = iter(range(1 << 30))

    def first_time(now: float | None = None) -> None:
        index.leading_runs(prompts[next(turn) % FIRSTS], now=now)

    full = median_us(first_time, repeat=FIRSTS)
    remembered = median_us(lambda: index.leading_runs(prompt), repeat=200)
    index.add_speculative(5, prompt, expires_at=1e9)
    index.add_speculative(5, firsts, expires_at=1e9)
    speculative = median_us(lambda: first_time(1.0), repeat=FIRSTS)
    miss = [rng.getrandbits(64) for _ in range(PROMPT_KEYS)]
    cold = median_us(lambda: index.leading_runs(miss), repeat=200)
    return [
        Figure(f"leading_runs, {PROMPT_KEYS} keys x {REPLICAS} replicas (median)", full, "us", 100),
        Figure("  same, with speculative entries", speculative, "us", 100),
        Figure("  same, looked up before: read from its remembered beginning", remembered, "us"),
        Figure("  same, first key held nowhere", cold, "us"),
    ]


def _memory_figures() -> list[Figure]:
    rng = random.Random(4)
    gc.collect()
    tracemalloc.start()
    index = BitmaskResidencyIndex()
    for replica in range(REPLICAS):
        index.add(replica, [rng.getrandbits(64) for _ in range(RESIDENT_KEYS // REPLICAS)])
    shared = [k for k in range(0, RESIDENT_KEYS, 4)]  # a quarter also on a second replica
    index.add(1, shared[: len(shared) // 8])
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    keys = index.key_count()
    started = time.perf_counter()
    index.clear_replica(7)
    clear_ms = (time.perf_counter() - started) * 1000
    return [
        Figure(f"memory for {keys / 1e6:.2f}M resident keys", size / 2**20, "MB", 120),
        Figure("  per key", size / keys, "B"),
        Figure(f"clear_replica over {keys / 1e6:.2f}M keys", clear_ms, "ms"),
        Figure("  clear_replica_steps, longest step", _longest_step_ms(index, 8), "ms"),
    ]


def _longest_step_ms(index: BitmaskResidencyIndex, replica: int) -> float:
    longest, last = 0.0, time.perf_counter()
    for _ in index.clear_replica_steps(replica):
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest * 1000


def run() -> list[Figure]:
    return _lookup_figures() + _memory_figures()
