"""Models of the peer routers' published algorithms, at their default settings.

Written from the peers' public source (facts only; nothing copied), at block granularity:
a prompt is its router block keys, and a match of n blocks stands for the n * block_size
tokens (or ~4 characters per token) the peer's own tree would match.

- ``sglang:cache_aware`` (sgl-router ``policies/cache_aware.rs``, CLI defaults
  ``--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5``,
  tree of up to 2**26 characters per worker, LRU-evicted every 120 s): an *approximate*
  tree of the prompts this router instance sent to each worker (not the engines' caches);
  load is this instance's own in-flight count per worker. When ``max - min > abs`` and
  ``max > rel * min`` the least-loaded worker wins; otherwise the worker at the deepest
  matched node wins if ``matched / prompt > cache_threshold``, else the least-loaded one
  (the first in order on ties). The prompt is inserted for the chosen worker either way.
- ``vllm-router:cache_aware`` (vllm-project/router, the same algorithm; its
  ``CacheAwareConfig`` defaults ``cache_threshold 0.5``, ``balance_abs 32``,
  ``balance_rel 1.1``, eviction every 30 s down to ``max_tree_size`` 10,000 characters
  per worker).
- ``llm-d:precise`` (llm-d inference scheduler): the precise prefix-cache scorer over an
  index fed by the engines' KV events (each pod's longest consecutive run of the prompt's
  blocks, min-max normalised over the pods that hold any, 1.0 when they tie; speculative
  entries for 2 s), the queue scorer (waiting requests, min-max normalised, shorter is
  better, 1.0 when equal) and the KV-utilisation scorer (``1 - kv_usage``), weighted
  3 / 2 / 2; metrics scraped every 50 ms; highest total wins, ties at random.
- ``dynamo:kv`` (NVIDIA Dynamo KV router, ``--kv-overlap-score-weight 1``, temperature
  0): cost per worker = ``overlap_weight * prefill_blocks + decode_blocks``, where
  prefill blocks are this prompt's blocks the worker's event-fed index lacks plus the
  prefill work the router already sent there and has not seen a first token for, and
  decode blocks are the distinct blocks of the worker's active requests (its own
  bookkeeping, shared by all router replicas) plus this prompt's new ones; lowest wins.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.engine import EngineShape
from bench.sim.simulator import FleetReadout
from bench.sim.workloads import Request
from kvcore.index import BitmaskResidencyIndex

CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class CacheAwareDefaults:
    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float
    eviction_interval_s: float
    max_tree_chars: int


SGLANG = CacheAwareDefaults(0.3, 64, 1.5, 120.0, 2**26)
VLLM_ROUTER = CacheAwareDefaults(0.5, 32, 1.1, 30.0, 10_000)


class _Quiet:
    """Hooks a peer does not use."""

    wants_residency = False
    load_period_s = float("inf")

    def apply_residency(self, replica: int, stored: list[int], removed: list[int]) -> None:
        del replica, stored, removed

    def on_first_token(self, req: Request, now: float) -> None:
        del req, now

    def on_finished(self, req: Request, now: float) -> None:
        del req, now


class ApproximateTree:
    """Which worker this router sent each prefix to, with per-worker LRU size limits."""

    def __init__(self, workers: int) -> None:
        self.owners: dict[int, int] = {}  # key -> bitmask of workers
        self.latest: dict[int, int] = {}  # key -> the worker that touched it last
        self.lru = [OrderedDict[int, None]() for _ in range(workers)]

    def match(self, keys: Sequence[int]) -> tuple[int, int | None]:
        """(blocks matched, worker at the deepest matched node)."""
        owners = self.owners
        depth = 0
        for key in keys:
            if key not in owners:
                break
            depth += 1
        return depth, (self.latest[keys[depth - 1]] if depth else None)

    def insert(self, keys: Sequence[int], worker: int) -> None:
        bit = 1 << worker
        owners, latest, lru = self.owners, self.latest, self.lru[worker]
        for key in keys:
            owners[key] = owners.get(key, 0) | bit
            latest[key] = worker
            lru[key] = None
            lru.move_to_end(key)

    def evict(self, max_blocks: int) -> None:
        for worker, lru in enumerate(self.lru):
            while len(lru) > max_blocks:
                key, _ = lru.popitem(last=False)
                mask = self.owners[key] & ~(1 << worker)
                if mask:
                    self.owners[key] = mask
                    if self.latest[key] == worker:
                        self.latest[key] = mask.bit_length() - 1
                else:
                    del self.owners[key]
                    del self.latest[key]


class CacheAwareRouter(_Quiet):
    """SGLang router's (or vllm-router's) ``cache_aware`` policy, one instance."""

    def __init__(
        self, name: str, defaults: CacheAwareDefaults, fleet: FleetReadout, shape: EngineShape
    ):
        self.name = name
        self.defaults = defaults
        n = len(fleet.replicas)
        self.tree = ApproximateTree(n)
        self.load = [0] * n
        self._block_chars = shape.block_size * CHARS_PER_TOKEN
        self._block_size = shape.block_size
        self._next_eviction = defaults.eviction_interval_s

    def route(self, req: Request, now: float) -> int:
        if now >= self._next_eviction:
            self.tree.evict(self.defaults.max_tree_chars // self._block_chars)
            self._next_eviction = now + self.defaults.eviction_interval_s
        load = self.load
        least = min(range(len(load)), key=load.__getitem__)
        worker = least
        if not self._imbalanced():
            matched, holder = self.tree.match(req.keys)
            rate = matched * self._block_size / req.prompt_tokens
            if holder is not None and rate > self.defaults.cache_threshold:
                worker = holder
        self.tree.insert(req.keys, worker)
        load[worker] += 1
        return worker

    def _imbalanced(self) -> bool:
        high, low = max(self.load), min(self.load)
        d = self.defaults
        return high - low > d.balance_abs_threshold and high > d.balance_rel_threshold * low

    def on_finished(self, req: Request, now: float) -> None:
        self.load[req.replica] -= 1


class LlmdRouter(_Quiet):
    """llm-d's scheduler with the precise prefix-cache, queue and KV-utilisation scorers."""

    wants_residency = True
    load_period_s = 0.05
    weights = (3.0, 2.0, 2.0)
    speculative_ttl_s = 2.0

    def __init__(self, fleet: FleetReadout, seed: int):
        self.name = "llm-d:precise"
        self.fleet = fleet
        self.index = BitmaskResidencyIndex()
        self._rng = random.Random(seed)
        self._samples = fleet.samples
        self._taken_at = -1e18
        self._next_expiry = 1.0

    def route(self, req: Request, now: float) -> int:
        if self.fleet.sampled_at - self._taken_at >= self.load_period_s - 1e-9:
            self._samples, self._taken_at = self.fleet.samples, self.fleet.sampled_at
        if now >= self._next_expiry:
            self.index.expire(now)
            self._next_expiry = now + 1.0
        runs = self.index.leading_runs(req.keys, now=now)
        prefix = _min_max(runs, higher_is_better=True)
        queues = {i: s.waiting for i, s in enumerate(self._samples)}
        queue = _min_max(queues, higher_is_better=False)
        w_prefix, w_queue, w_kv = self.weights
        scores = [
            w_prefix * prefix.get(i, 0.0) + w_queue * queue[i] + w_kv * (1.0 - s.kv_usage)
            for i, s in enumerate(self._samples)
        ]
        top = max(scores)
        chosen = self._rng.choice([i for i, s in enumerate(scores) if s >= top - 1e-12])
        self.index.add_speculative(chosen, req.keys, expires_at=now + self.speculative_ttl_s)
        return chosen

    def apply_residency(self, replica: int, stored: list[int], removed: list[int]) -> None:
        if stored:
            self.index.add(replica, stored)
        if removed:
            self.index.remove(replica, removed)


def _min_max(values: dict[int, int], *, higher_is_better: bool) -> dict[int, float]:
    """llm-d's normalisation: (v - min) / (max - min), or 1.0 for all when they tie."""
    if not values:
        return {}
    low, high = min(values.values()), max(values.values())
    if high == low:
        return dict.fromkeys(values, 1.0)
    span = high - low
    if higher_is_better:
        return {k: (v - low) / span for k, v in values.items()}
    return {k: (high - v) / span for k, v in values.items()}


class DynamoBook:
    """Dynamo's active-sequence bookkeeping, shared by all router replicas."""

    def __init__(self, workers: int) -> None:
        self.active = [Counter[int]() for _ in range(workers)]
        self.pending_prefill = [0.0] * workers  # blocks sent, first token not yet seen
        self.prefill_of: dict[int, float] = {}


class DynamoRouter(_Quiet):
    """Dynamo's KV router: lowest ``overlap_weight * prefill_blocks + decode_blocks``."""

    wants_residency = True
    overlap_weight = 1.0

    def __init__(self, fleet: FleetReadout, book: DynamoBook, shape: EngineShape, seed: int):
        self.name = "dynamo:kv"
        self.book = book
        self.index = BitmaskResidencyIndex()
        self._n = len(fleet.replicas)
        self._bs = shape.block_size
        self._rng = random.Random(seed)

    def route(self, req: Request, now: float) -> int:
        runs = self.index.leading_runs(req.keys, now=None)
        book = self.book
        blocks = -(-req.prompt_tokens // self._bs)
        costs = []
        for w in range(self._n):
            uncached = blocks - runs.get(w, 0)
            active = book.active[w]
            new_active = sum(1 for key in req.keys if key not in active) if active else blocks
            prefill = uncached + book.pending_prefill[w]
            decode = len(active) + new_active
            costs.append(self.overlap_weight * prefill + decode)
        low = min(costs)
        chosen = self._rng.choice([w for w, c in enumerate(costs) if c <= low + 1e-9])
        book.active[chosen].update(req.keys)
        uncached = blocks - runs.get(chosen, 0)
        book.pending_prefill[chosen] += uncached
        book.prefill_of[req.rid] = uncached
        return chosen

    def apply_residency(self, replica: int, stored: list[int], removed: list[int]) -> None:
        if stored:
            self.index.add(replica, stored)
        if removed:
            self.index.remove(replica, removed)

    def on_first_token(self, req: Request, now: float) -> None:
        self.book.pending_prefill[req.replica] -= self.book.prefill_of.pop(req.rid, 0.0)

    def on_finished(self, req: Request, now: float) -> None:
        active = self.book.active[req.replica]
        active.subtract(req.keys)
        for key in req.keys:
            if active.get(key, 1) <= 0:
                del active[key]
