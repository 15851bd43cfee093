"""Residency indexes side by side: prompt lookups, batch changes, memory per key.

Both implementations (and the compact one without its C lookup, where that is built:
before and after in one run) over the same keys: ``leading_runs`` of prompts never looked up
before (every key of every prompt new, each replica holding a prefix of it, as 64
replicas that served parts of a conversation do), batches added and removed, memory per
resident key (tracemalloc: numpy's arrays are traced too) and clearing a replica; and
what the choice costs a proxy: kv_aware's decision p50 at ordinary prompt sizes (a shared
system prompt, then each request's own blocks), speculation recorded as a proxy records it,
and its p99 while the fleet stores and evicts 200,000 blocks/s against a still fleet.
Still and churned decisions alternate in blocks of 2,000, so that the machine's bursts
fall on both. Under churn a proxy deciding 2,000 times a second applies 100 block events
between two decisions, on its one thread as its event loop does: the next decision pays
what the change left in the caches, but not the change itself, so each decision is timed
alone, in the thread's CPU time (a preempted decision is the machine's, not the index's);
the change's own time is a figure of its own, with its longest: the stall of the event
loop when the index rebuilds its table (the churn runs past the first rebuild). The
bench's record of what each replica holds costs nothing beside it (a deque: the oldest
blocks evicted, the new ones appended).
Last, a dict's lookups alone of new prompts' keys: the floor under the dict index.
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from functools import partial
from itertools import repeat

import numpy as np

from bench.micro.report import Figure, median_us_each
from kvcore.index import (
    NATIVE_LOOKUP,
    READ_ALWAYS_INDEXES,
    CompactResidencyIndex,
    ResidencyIndex,
)
from kvcore.policies import ReplicaState, RouteContext, StaticStateView, create_policy
from kvcore.workload import parse_workload

REPLICAS = 64
RESIDENT_KEYS = 1_000_000
BATCH = 100_000
PROMPTS = 100  # distinct prompts per length, each looked up once
LOOKUP_TARGETS_US = {512: 100.0, 2048: 200.0}
MIN_KEYS_PER_S = 1e6
MAX_BYTES_PER_KEY = 48.0  # the compact index's; the bitmask index is reported only
ORDINARY_BLOCKS = (16, 64, 256)  # prompts of 256 to 4,096 tokens
CHURN_PER_DECISION = 100  # block events between two decisions: 200,000/s at 2,000/s
# still and churned decisions in alternate blocks (the machine's bursts fall on both), the
# churned ones past the first rebuild of the compact index's table at 1M keys (~620,000
# stored keys)
DECISION_BLOCK = 2_000
DECISION_BLOCKS = 7


def _lookup_figures(name: str, make: Callable[[], ResidencyIndex]) -> list[Figure]:
    rng = random.Random(3)
    index = make()
    index.add(0, [rng.getrandbits(64) for _ in range(100_000)])
    figures = []
    for length, target in LOOKUP_TARGETS_US.items():
        prompts = [[rng.getrandbits(64) for _ in range(length)] for _ in range(PROMPTS)]
        for prompt in prompts:
            for replica in range(REPLICAS):
                held = length if replica % 4 == 0 else rng.randrange(length)
                index.add(replica, prompt[:held])
        us = median_us_each([partial(index.leading_runs, p) for p in prompts])
        figures.append(
            Figure(
                f"{name}: leading_runs, {length} keys x {REPLICAS} replicas, new prompts",
                us,
                "us",
                target,
            )
        )
        index.add_speculative(5, prompts[0], expires_at=1e9)
        us = median_us_each([partial(index.leading_runs, p, now=1.0) for p in prompts])
        figures.append(Figure("  same, counting speculative entries", us, "us"))
    return figures


def _batch_figures(name: str, make: Callable[[], ResidencyIndex]) -> list[Figure]:
    """Batches made while memory is traced and dropped once added, so that what the
    index keeps (for a dict, the key objects too) is what is counted."""
    rng = random.Random(4)
    gc.collect()
    tracemalloc.start()
    index, added, kept = make(), 0.0, []
    for number in range(RESIDENT_KEYS // BATCH):
        batch = [rng.getrandbits(64) for _ in range(BATCH)]
        started = time.perf_counter()
        index.add(number % REPLICAS, batch)
        added += time.perf_counter() - started
        kept.append(np.array(batch, dtype=np.uint64))  # (for the removals below)
        del batch
    size, _ = tracemalloc.get_traced_memory()
    size -= sum(b.nbytes for b in kept)
    tracemalloc.stop()
    batches: list[list[int]] = [b.tolist() for b in kept]
    for number, batch in enumerate(batches[:3]):  # a second holder for some keys
        index.add((number + 1) % REPLICAS, batch)
    started = time.perf_counter()
    for number, batch in enumerate(batches):
        index.remove(number % REPLICAS, batch)
    removed = time.perf_counter() - started
    keys = len(batches) * BATCH
    per_key = size / keys
    return [
        Figure(f"{name}: add, {BATCH:,}-key batches", keys / added / 1e6, "M keys/s"),
        Figure(f"{name}: remove, {BATCH:,}-key batches", keys / removed / 1e6, "M keys/s"),
        Figure(
            f"{name}: memory per resident key at {keys / 1e6:.0f}M keys",
            per_key,
            "B",
            MAX_BYTES_PER_KEY if name.startswith("compact") else None,
        ),
        Figure(f"{name}: clear_replica of 1 of {REPLICAS}", _clear_ms(index), "ms"),
    ]


def _clear_ms(index: ResidencyIndex) -> float:
    index.add(7, range(1, 200_001))
    started = time.perf_counter()
    index.clear_replica(7)
    return (time.perf_counter() - started) * 1000


def _rate_figure(figure: Figure) -> Figure:
    """A rate's target is a lower bound; :class:`Figure` holds upper bounds, so the
    rate is printed against the time a million keys take."""
    seconds = 1 / figure.value
    return Figure(f"{figure.name} (s per 1M keys)", seconds, "s", 1e6 / MIN_KEYS_PER_S)


def _decision_figures(name: str, make: Callable[[], ResidencyIndex]) -> list[Figure]:
    rng = random.Random(6)
    figures = []
    for blocks in ORDINARY_BLOCKS:
        states = [ReplicaState(i, f"r{i}", running=rng.randrange(40)) for i in range(REPLICAS)]
        view = StaticStateView(states, make())
        system = [rng.getrandbits(64) for _ in range(blocks * 3 // 4)]
        for quarter, holder in enumerate(rng.sample(range(REPLICAS), 4), 1):
            view.index.add(holder, system[: len(system) * quarter // 4])
        workload = parse_workload({"strategy": "kv_aware"})
        policy = create_policy(workload, rng=random.Random(1))
        prompts = [
            [*system, *(rng.getrandbits(64) for _ in range(blocks - len(system)))]
            for _ in range(300)
        ]
        decisions = [
            partial(policy.select, RouteContext(workload, "m", p, now=1.0 + i / 1000), view)
            for i, p in enumerate(prompts)
        ]
        us = median_us_each(decisions)
        figures.append(Figure(f"{name}: kv_aware decision p50, {blocks} blocks", us, "us"))
    return figures


def _churn_figures(name: str, make: Callable[[], ResidencyIndex]) -> list[Figure]:
    rng = random.Random(8)
    states = [ReplicaState(i, f"r{i}", running=rng.randrange(40)) for i in range(REPLICAS)]
    view = StaticStateView(states, make())
    held: list[deque[int]] = []
    for replica in range(REPLICAS):
        held.append(deque(rng.getrandbits(64) for _ in range(RESIDENT_KEYS // REPLICAS)))
        view.index.add(replica, list(held[-1]))
    system = [rng.getrandbits(64) for _ in range(48)]
    for quarter, holder in enumerate(rng.sample(range(REPLICAS), 4), 1):
        view.index.add(holder, system[: len(system) * quarter // 4])
    workload = parse_workload({"strategy": "kv_aware"})
    policy = create_policy(workload, rng=random.Random(1))
    changes: list[float] = []

    def churn() -> None:
        """An engine's stored and evicted blocks, as a proxy applies them."""
        replica, half = rng.randrange(REPLICAS), CHURN_PER_DECISION // 2
        stored = [rng.getrandbits(64) for _ in range(half)]
        evicted = [held[replica].popleft() for _ in range(half)]
        held[replica].extend(stored)
        started = time.thread_time_ns()
        view.index.add(replica, stored)
        view.index.remove(replica, evicted)
        changes.append((time.thread_time_ns() - started) / 1000)

    def decide(i: int) -> float:
        prompt = [*system, *(rng.getrandbits(64) for _ in range(16))]
        ctx = RouteContext(workload, "m", prompt, now=1.0 + i / 1000)
        started = time.thread_time_ns()
        policy.select(ctx, view)
        return (time.thread_time_ns() - started) / 1000

    samples: dict[bool, list[float]] = {False: [], True: []}  # churning: decisions' CPU us
    for block in range(2 * DECISION_BLOCKS):
        churning = block % 2 == 1
        for i in range(DECISION_BLOCK):
            if churning:
                churn()
            samples[churning].append(decide(i))
    still, churned = (sorted(s)[int(len(s) * 0.99)] for s in samples.values())
    return [
        Figure(f"{name}: kv_aware decision p99, 64 blocks, fleet still (CPU)", still, "us"),
        Figure(
            "  same, fleet storing and evicting 200,000 blocks/s (x still)",
            churned / still,
            "x",
            2.0,
        ),
        Figure(
            f"  applying the {CHURN_PER_DECISION} block events between two decisions, median",
            sorted(changes)[len(changes) // 2],
            "us",
        ),
        Figure(
            "  the longest of those (a rebuild holding the event loop)", max(changes) / 1000, "ms"
        ),
    ]


def _numpy_compact() -> ResidencyIndex:
    index = CompactResidencyIndex(hold_changes=False)
    index.native = None
    return index


def indexes() -> dict[str, Callable[[], ResidencyIndex]]:
    """The proxy's choices, and where the compact index reads prompts in C, the same
    without it (numpy, as in a checkout with no compiler), side by side."""
    variants = dict(READ_ALWAYS_INDEXES)
    if NATIVE_LOOKUP:
        variants["compact without C"] = _numpy_compact
    return variants


def _dict_floor() -> list[Figure]:
    """What a dict index cannot go below on prompts never looked up: the dict lookups
    alone, one per key (``map(dict.get)`` at C speed), of keys added as the lookup
    figures add them."""
    rng = random.Random(3)
    masks: dict[int, int] = {rng.getrandbits(64): 1 for _ in range(100_000)}
    figures = []
    for length in LOOKUP_TARGETS_US:
        prompts = [[rng.getrandbits(64) for _ in range(length)] for _ in range(PROMPTS)]
        for prompt in prompts:
            for key in prompt:
                masks[key] = rng.getrandbits(64)
        us = median_us_each([partial(_gets, masks, p) for p in prompts])
        figures.append(Figure(f"a dict's get of each of {length} new keys alone", us, "us"))
    return figures


def _gets(masks: dict[int, int], keys: list[int]) -> list[int]:
    return list(map(masks.get, keys, repeat(0)))


def run() -> list[Figure]:
    figures: list[Figure] = []
    for name, make in indexes().items():
        figures += _decision_figures(name, make)
        figures += _churn_figures(name, make)
        figures += _lookup_figures(name, make)
        batch = _batch_figures(name, make)
        figures += [_rate_figure(f) if f.unit == "M keys/s" else f for f in batch]
    return figures + _dict_floor()
