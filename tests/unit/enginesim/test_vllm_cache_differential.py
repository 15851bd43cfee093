"""enginesim's vLLM mode against a reference model of vLLM 0.33.0's own algorithm.

``VllmReference`` below is written from vLLM 0.33.0's source (``vllm/v1/core/block_pool.py``,
``kv_cache_utils.py``'s ``FreeKVCacheBlockQueue``, ``kv_cache_manager.py``,
``single_type_kv_cache_manager.py``'s ``FullAttentionManager``, ``sched/scheduler.py``'s
``schedule``, ``update_from_output``, ``_preempt_request``, ``finish_requests`` and
``reset_prefix_cache``), for one full-attention group with prefix caching, KV events,
FCFS, no chunked prefill and synchronous scheduling. It is deliberately plain and shaped
unlike ``enginesim.blockpool``: the free queue is a Python list (head at index 0), the
cache a dict of hash to a list of block ids, the blocks' state parallel lists, the
scheduler one function per vLLM method. CI cannot install vLLM, so the model is the
stand-in.

Both are driven with the same randomized streams (Zipf-weighted shared prefixes, random
suffixes, block-aligned repeats, ``n``-sample twins, prompts longer than the cache,
aborts and prefix-cache resets; sequential and concurrent; 16 to 4,096 blocks of 16 or
32 tokens), and after every step must agree on the events, every cached hash's block
ids, the free queue's order, each running request's block table and the queues; and, per
request, on the cached tokens clients see.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginesim.blockpool import VllmKVCacheManager
from enginesim.errors import RequestRejected
from enginesim.kv_manager import AllCleared, BlockEvicted, BlocksStored, PoolEvent
from enginesim.request import SimRequest
from enginesim.scheduler import CoreLimits, EngineCore
from enginesim.timing import TimingModel

FILLER = tuple(range(7, 19))  # sampled tokens; short, so answers repeat across requests
Event = tuple[object, ...]


class FastHasher:
    """A cheap chained block hash (the hash function is not under test here)."""

    def block_digest(
        self, parent: bytes | None, tokens: Sequence[int], salt: str | None, lora: object = None
    ) -> bytes:
        h = hashlib.blake2b(parent or b"root", digest_size=12)
        h.update(repr((tuple(tokens), salt, lora)).encode())
        return h.digest()

    def event_id(self, digest: bytes) -> int:
        return int.from_bytes(digest[-8:], "big")


# -- the reference: vLLM 0.33.0, plainly --------------------------------------------------


@dataclass(eq=False)
class RefRequest:
    rid: str
    prompt: list[int]
    max_tokens: int
    salt: str | None
    output: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # set at the first scheduling, as vLLM's Request

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class VllmReference:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        self.bs = block_size
        self.num_gpu_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.hasher = FastHasher()
        # BlockPool.__init__: the queue in block-id order, then the null block popped
        self.free_queue: list[int] = list(range(num_blocks))
        self.null_block = self.free_queue.pop(0)
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, list[int]] = {}  # BlockHashToBlockMap, oldest first
        self.kv_event_queue: list[Event] = []
        # SingleTypeKVCacheManager
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}
        # Scheduler
        self.waiting: list[RefRequest] = []
        self.running: list[RefRequest] = []

    # Request.update_block_hashes: every full block of all_token_ids, chained
    def update_block_hashes(self, req: RefRequest) -> None:
        tokens, bs = req.all_token_ids, self.bs
        while (len(req.block_hashes) + 1) * bs <= len(tokens):
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            salt = req.salt if i == 0 else None
            req.block_hashes.append(
                self.hasher.block_digest(parent, tokens[i * bs : (i + 1) * bs], salt)
            )

    # -- BlockPool ------------------------------------------------------------------------

    def get_cached_block(self, h: bytes) -> int | None:
        ids = self.cached.get(h)
        return ids[0] if ids else None

    def maybe_evict_cached_block(self, b: int) -> None:
        h = self.block_hash[b]
        if h is None:
            return
        self.block_hash[b] = None
        ids = self.cached.get(h)
        if ids is None or b not in ids:
            return
        ids.remove(b)
        if not ids:
            del self.cached[h]
        self.kv_event_queue.append(("BlockRemoved", h))

    def get_new_blocks(self, n: int) -> list[int]:
        assert n <= len(self.free_queue)
        taken, self.free_queue = self.free_queue[:n], self.free_queue[n:]
        for b in taken:
            self.maybe_evict_cached_block(b)
            assert self.ref_cnt[b] == 0
            self.ref_cnt[b] += 1
        return taken

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self.free_queue.remove(b)
            self.ref_cnt[b] += 1

    def free_blocks(self, ordered: list[int]) -> None:
        evict_first, evict_last = [], []
        for b in ordered:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                (evict_first if self.block_hash[b] is None else evict_last).append(b)
        self.free_queue = evict_first + self.free_queue + evict_last

    def cache_full_blocks(self, req: RefRequest, start: int, end: int) -> None:
        blocks = self.req_to_blocks[req.rid]
        for i in range(start, end):
            h = req.block_hashes[i]
            self.block_hash[blocks[i]] = h
            self.cached.setdefault(h, []).append(blocks[i])
        parent = req.block_hashes[start - 1] if start else None
        tokens = tuple(req.all_token_ids[start * self.bs : end * self.bs])
        salt = req.salt if start == 0 else None
        self.kv_event_queue.append(
            ("BlockStored", tuple(req.block_hashes[start:end]), parent, tokens, salt)
        )

    def reset_prefix_cache(self) -> bool:
        if self.num_gpu_blocks - len(self.free_queue) != 1:
            return False
        self.cached = {}
        self.block_hash = [None] * self.num_gpu_blocks
        self.kv_event_queue.append(("AllBlocksCleared",))
        return True

    # -- KVCacheManager ---------------------------------------------------------------------

    def get_computed_blocks(self, req: RefRequest) -> list[int]:
        hits = []
        for h in req.block_hashes[: (req.num_tokens - 1) // self.bs]:
            b = self.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, req: RefRequest, num_new_tokens: int, hits: list[int]) -> bool:
        num_computed = req.num_computed_tokens + len(hits) * self.bs
        num_tokens_need_slot = num_computed + num_new_tokens
        required = -(-num_tokens_need_slot // self.bs)
        if req.rid in self.num_cached_block:
            to_allocate = max(required - len(self.req_to_blocks[req.rid]), 0)
        else:
            evictable = sum(1 for b in hits if self.ref_cnt[b] == 0)
            to_allocate = max(required - len(hits), 0) + evictable
        if to_allocate > len(self.free_queue):
            return False
        if req.rid not in self.num_cached_block:
            self.touch(hits)
            self.req_to_blocks[req.rid] = list(hits)
            self.num_cached_block[req.rid] = len(hits)
        blocks = self.req_to_blocks[req.rid]
        blocks.extend(self.get_new_blocks(required - len(blocks)))
        # cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        num_full = min(num_computed + num_new_tokens, req.num_tokens) // self.bs
        if self.num_cached_block[req.rid] < num_full:
            self.cache_full_blocks(req, self.num_cached_block[req.rid], num_full)
            self.num_cached_block[req.rid] = num_full
        return True

    def free(self, req: RefRequest) -> None:
        blocks = self.req_to_blocks.pop(req.rid, [])
        self.num_cached_block.pop(req.rid, None)
        self.free_blocks(list(reversed(blocks)))

    # -- Scheduler ----------------------------------------------------------------------

    def add_request(self, req: RefRequest) -> bool:
        """False for a request the engine refuses (longer than its KV cache)."""
        needed = -(-(len(req.prompt) + req.max_tokens - 1) // self.bs)
        if needed > self.num_gpu_blocks - 1:
            return False
        self.update_block_hashes(req)
        self.waiting.append(req)
        return True

    def preempt(self, req: RefRequest) -> None:
        self.free(req)
        req.num_computed_tokens = 0
        self.waiting.insert(0, req)

    def schedule(self) -> list[tuple[RefRequest, int]]:
        scheduled: list[tuple[RefRequest, int]] = []
        preempted = False
        i = 0
        while i < len(self.running):
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            while not (ok := self.allocate_slots(req, num_new, [])):
                victim = self.running.pop()
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if not ok:
                break
            scheduled.append((req, num_new))
            i += 1
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self.get_computed_blocks(req)
            num_new = req.num_tokens - len(hits) * self.bs
            if not self.allocate_slots(req, num_new, hits):
                break
            self.waiting.pop(0)
            self.running.append(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = len(hits) * self.bs
            req.num_computed_tokens = len(hits) * self.bs
            scheduled.append((req, num_new))
        for req, num_new in scheduled:  # _update_after_schedule
            req.num_computed_tokens += num_new
        return scheduled

    def update_from_output(self, scheduled: list[tuple[RefRequest, int]]) -> None:
        for req, _ in scheduled:
            req.output.append(FILLER[len(req.output) % len(FILLER)])
            self.update_block_hashes(req)
            if len(req.output) >= req.max_tokens:  # check_stop
                self.running.remove(req)
                self.free(req)

    def step(self) -> list[Event]:
        self.update_from_output(self.schedule())
        return self.take_events()

    def take_events(self) -> list[Event]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def abort(self, req: RefRequest) -> None:
        if req in self.running:
            self.running.remove(req)
            self.free(req)
        elif req in self.waiting:
            self.waiting.remove(req)


# -- the streams ------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    step: int  # in sequential streams, the order only
    prompt: list[int]
    max_tokens: int
    salt: str | None


def tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` token ids from a small vocabulary (so blocks sometimes match by chance)."""
    return [b & 63 for b in rng.randbytes(n)]


def make_stream(rng: random.Random, num_blocks: int, bs: int, n: int, concurrent: bool):
    """Zipf-weighted shared prefixes with random suffixes, some block-aligned repeats,
    some twins (``n`` samples), some prompts longer than the cache."""
    capacity = (num_blocks - 1) * bs
    longest = min(capacity, 8000)
    lengths = [bs - 1, bs, 2 * bs, 3 * bs + 5, longest // 4, longest // 2]
    sizes = [longest // 2, longest * 3 // 4, *rng.choices(lengths, k=rng.randint(0, 6))]
    prefixes = [tokens(rng, max(1, size)) for size in sizes]
    rng.shuffle(prefixes)
    weights = [1 / (k + 1) ** 1.2 for k in range(len(prefixes))]
    stream: list[Arrival] = []
    step = 0
    for _ in range(n):
        step += rng.choice((0, 0, 1, 1, 2, 5)) if concurrent else 1
        roll = rng.random()
        if roll < 0.03:
            prompt = tokens(rng, capacity + rng.randint(1, 2 * bs))
        else:
            prompt = list(rng.choices(prefixes, weights)[0])
            if roll > 0.2:  # else the prefix alone: block-aligned prompts repeat exactly
                prompt += tokens(rng, rng.randint(1, 3 * bs))
        salt = "tenant" if rng.random() < 0.1 else None
        max_tokens = rng.randint(1, 3 * bs)
        copies = 2 if rng.random() < 0.1 else 1  # n samples of one prompt
        for _ in range(copies):
            stream.append(Arrival(step, prompt, max_tokens, salt))
    return stream


# -- the drive ---------------------------------------------------------------------------


def as_events(events: list[PoolEvent]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if isinstance(e, BlocksStored):
            out.append(("BlockStored", e.digests, e.parent, e.token_ids, e.salt))
        elif isinstance(e, BlockEvicted):
            out.append(("BlockRemoved", e.digest))
        else:
            assert isinstance(e, AllCleared)
            out.append(("AllBlocksCleared",))
    return out


class Pair:
    """The simulator and the reference, stepped together and compared after each step."""

    def __init__(self, num_blocks: int, bs: int, max_num_seqs: int) -> None:
        self.kv = VllmKVCacheManager(num_blocks, bs)
        limits = CoreLimits(bs, num_blocks, max_num_seqs, max_model_len=10**9)
        self.core = EngineCore(limits, FastHasher(), TimingModel(), self.kv, FILLER)
        self.ref = VllmReference(num_blocks, bs, max_num_seqs)
        self.reqs: list[tuple[SimRequest, RefRequest]] = []
        self.steps = 0
        self.seen = {"evicted": 0, "preempted": 0, "copies": 0, "hits": 0, "rejected": 0}

    def add(self, arrival: Arrival) -> None:
        rid = str(len(self.reqs))
        sim = SimRequest(rid, arrival.prompt, arrival.max_tokens, arrival.salt)
        ref = RefRequest(rid, list(arrival.prompt), arrival.max_tokens, arrival.salt)
        try:
            self.core.add(sim)
            accepted = True
        except RequestRejected:
            accepted = False
        assert self.ref.add_request(ref) == accepted
        self.reqs.append((sim, ref))
        self.seen["rejected"] += not accepted

    def step(self) -> None:
        out = self.core.step()
        want = self.ref.step()
        self.expect_events(want)
        self.steps += 1
        self.compare(cache=bool(want))
        self.seen["preempted"] += len(out.preempted)
        for req in out.finished:
            ref = self.ref_of(req)
            assert ref.output == req.output
            assert req.num_cached_tokens == ref.num_cached_tokens
            self.seen["hits"] += req.num_cached_tokens > 0

    def expect_events(self, want: list[Event]) -> None:
        assert as_events(self.kv.take_events()) == want, f"step {self.steps}"
        self.seen["evicted"] += sum(e[0] == "BlockRemoved" for e in want)
        self.seen["copies"] = max(self.seen["copies"], *map(len, self.ref.cached.values()), 0)

    def compare(self, cache: bool = True) -> None:
        """``cache``: the cached hashes too (they change only with an event)."""
        pool, ref = self.kv.pool, self.ref
        assert pool.free_block_ids() == ref.free_queue
        if cache:
            assert pool.resident() == ref.cached
        assert [r.request_id for r in self.core.running] == [r.rid for r in ref.running]
        assert [r.request_id for r in self.core.waiting] == [r.rid for r in ref.waiting]
        for req in self.core.running:
            assert self.kv.block_ids(req) == ref.req_to_blocks[req.request_id]

    def ref_of(self, req: SimRequest) -> RefRequest:
        return self.reqs[int(req.request_id)][1]

    def abort_one(self, rng: random.Random) -> None:
        live = [pair for pair in self.reqs if not pair[0].finished]
        if live:
            sim, ref = rng.choice(live)
            self.core.abort(sim)
            self.ref.abort(ref)
            self.expect_events(self.ref.take_events())
            self.compare()

    def reset_prefix_cache(self) -> None:
        assert self.kv.clear() == self.ref.reset_prefix_cache()
        self.expect_events(self.ref.take_events())
        self.compare()

    def drain(self) -> None:
        while self.core.has_work:
            self.step()
        assert not self.ref.running and not self.ref.waiting


def run_stream(seed: int, num_blocks: int, bs: int, concurrent: bool, n: int) -> Pair:
    rng = random.Random(seed)
    pair = Pair(num_blocks, bs, max_num_seqs=rng.choice((16, 64) if concurrent else (1, 4)))
    stream = make_stream(rng, num_blocks, bs, n, concurrent)
    if not concurrent:
        for arrival in stream:
            pair.add(arrival)
            pair.drain()
            if rng.random() < 0.02:
                pair.reset_prefix_cache()
        return pair
    i = 0
    while i < len(stream) or pair.core.has_work:
        while i < len(stream) and stream[i].step <= pair.steps:
            pair.add(stream[i])
            i += 1
        if rng.random() < 0.01:
            pair.abort_one(rng)
        if rng.random() < 0.01:
            pair.reset_prefix_cache()
        if pair.core.has_work:
            pair.step()
        else:
            pair.steps += 1
    pair.drain()
    return pair


# -- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "concurrent"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("num_blocks", [16, 64, 200, 400, 4096])
def test_the_simulator_caches_and_evicts_as_vllm(
    num_blocks: int, bs: int, concurrent: bool
) -> None:
    pair = run_stream(num_blocks * 7 + bs + concurrent, num_blocks, bs, concurrent, n=100)
    seen = pair.seen
    assert seen["hits"] > 0 and seen["rejected"] > 0 and seen["copies"] >= 2
    if num_blocks <= 400:
        assert seen["evicted"] > 0, "a stream this size must cycle the cache"
    if concurrent and num_blocks <= 64:
        assert seen["preempted"] > 0, "a small cache under concurrency must preempt"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32),
    num_blocks=st.integers(16, 4096),
    bs=st.sampled_from([16, 32]),
    concurrent=st.booleans(),
)
def test_any_stream_any_cache_size(seed: int, num_blocks: int, bs: int, concurrent: bool) -> None:
    run_stream(seed, num_blocks, bs, concurrent, n=40)
