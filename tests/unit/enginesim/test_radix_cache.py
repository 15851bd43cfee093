"""What a client or a sidecar sees of SGLang mode's cache, where it differs from vLLM's
(the full semantics are held to SGLang's source in ``test_sglang_cache_differential.py``)."""

from __future__ import annotations

import random

import pytest

from enginesim.blockpool import VllmKVCacheManager
from enginesim.errors import RequestRejected
from enginesim.hashing import SglangSha256Hasher, VllmSha256CborHasher, prompt_digests
from enginesim.kv_manager import BlockEvicted, BlocksStored
from enginesim.radix_cache import SglangRadixCache
from enginesim.request import SimRequest
from enginesim.scheduler import CoreLimits, EngineCore
from enginesim.timing import TimingModel


def make_core(num_pages: int = 256, page_size: int = 1, max_running: int = 8) -> EngineCore:
    limits = CoreLimits(page_size, num_pages, max_running, max_model_len=1 << 16)
    cache = SglangRadixCache(num_pages, page_size)
    return EngineCore(limits, SglangSha256Hasher(), TimingModel(), cache)


def make_vllm_core(num_blocks: int, block_size: int) -> EngineCore:
    limits = CoreLimits(block_size, num_blocks, 8, max_model_len=1 << 16)
    kv = VllmKVCacheManager(num_blocks, block_size)
    return EngineCore(limits, VllmSha256CborHasher(), TimingModel(), kv)


def drain(core: EngineCore) -> None:
    while core.has_work:
        core.step()


def stored_tokens(core: EngineCore) -> list[tuple[int, ...]]:
    return [e.token_ids for e in core.kv.take_events() if isinstance(e, BlocksStored)]


def test_two_requests_admitted_together_share_nothing_and_store_once():
    """SGLang caches a prompt after its prefill: the second of two identical prompts in
    one step hits nothing (vLLM's would hit), and the tree keeps one copy."""
    core = make_core()
    prompt = list(range(100, 140))
    first, second = SimRequest("a", prompt, 1), SimRequest("b", prompt, 1)
    core.add(first)
    core.add(second)
    drain(core)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 0)
    assert stored_tokens(core) == [tuple(prompt)]
    third = SimRequest("c", prompt, 1)
    core.add(third)
    drain(core)
    assert third.num_cached_tokens == len(prompt) - 1


def test_output_is_cached_when_the_request_finishes_page_aligned():
    core = make_core(page_size=4)
    prompt = list(range(10))  # 2 full pages and 2 tokens
    req = SimRequest("a", prompt, 6)
    core.add(req)
    core.step()  # the prefill: the prompt's 2 full pages
    assert stored_tokens(core) == [tuple(prompt[:8])]
    while core.running:
        core.step()
        if core.running:
            assert stored_tokens(core) == []  # nothing while it decodes
    # 10 prompt + 5 computed output tokens = 15: 3 pages, the partial 4th freed
    assert stored_tokens(core) == [tuple(req.tokens[8:12])]


def test_the_oldest_unlocked_leaf_goes_first():
    core = make_core(num_pages=64)
    old, new = list(range(100, 130)), list(range(200, 230))
    for name, prompt in (("old", old), ("new", new)):
        core.add(SimRequest(name, prompt, 1))
        drain(core)
    core.kv.take_events()
    core.add(SimRequest("big", list(range(300, 320)), 1))  # needs 20 of 4 free pages
    drain(core)
    evicted = {e.digest for e in core.kv.take_events() if isinstance(e, BlockEvicted)}
    old_digests = SimRequest("x", old, 1)
    core.add(old_digests)
    assert evicted == set(old_digests.digests)


def test_a_prefill_only_prompt_longer_than_the_cache_is_refused():
    """Its prompt alone needs every page and one more: refused, not queued forever."""
    core = make_core(num_pages=64)
    with pytest.raises(RequestRejected):
        core.add(SimRequest("warm-up", list(range(65)), 0))


# -- driving the cache by hand, for paths a scheduler rarely takes -------------------------


def hand_request(name: str, prompt: list[int], max_tokens: int) -> SimRequest:
    req = SimRequest(name, prompt, max_tokens)
    req.digests = prompt_digests(SglangSha256Hasher(), req.tokens, 1, None)
    return req


def sample(req: SimRequest, token: int) -> None:
    req.output.append(token)
    req.digests = prompt_digests(SglangSha256Hasher(), req.tokens, 1, None)


def evicted(cache: SglangRadixCache) -> list[bytes]:
    return [e.digest for e in cache.take_events() if isinstance(e, BlockEvicted)]


def test_a_retraction_frees_twenty_tokens_per_request_left():
    """``release_req`` evicts so that each request still running has 20 tokens free."""
    cache = SglangRadixCache(64, 1)
    done = hand_request("done", list(range(100, 130)), 1)  # 30 tokens, cached, unlocked
    assert cache.admit(done)
    cache.after_forward([done])
    cache.finish(done)
    a, b = hand_request("a", list(range(200, 220)), 2), hand_request("b", list(range(300, 310)), 2)
    for req in (a, b):
        assert cache.admit(req)
        cache.after_forward([req])
    cache.take_events()
    assert cache.num_free == 4 + 30  # 4 free pages and the finished prompt
    cache.preempt(b)  # 14 free: one request left wants 20, so the old prompt goes
    assert set(evicted(cache)) == set(done.digests)


def test_a_resumed_requests_output_is_evicted_apart_from_its_prompt():
    """A request retracted, its prompt flushed, admitted again: its prompt and output
    are inserted together, and split at the prompt's end (``split_prompt``), so eviction
    takes the output first."""
    cache = SglangRadixCache(48, 1)
    req = hand_request("r", list(range(100, 110)), 20)
    assert cache.admit(req)
    cache.after_forward([req])
    sample(req, 1000)
    for token in (1001, 1002, 1003):
        assert cache.grow(req)
        cache.after_forward([])
        sample(req, token)
    cache.preempt(req)
    assert cache.clear()  # /flush_cache: nothing is cached any more
    assert cache.admit(req) and req.hit_tokens == 0
    cache.after_forward([req])  # the prompt and 4 outputs inserted as one
    cache.finish(req)
    cache.take_events()
    other = hand_request("o", list(range(500, 535)), 1)  # 35 pages of 34 free: 1 short
    assert cache.admit(other)
    cache.after_forward([other])
    assert evicted(cache) == req.digests[10:14]


def test_whole_node_eviction_keeps_less_of_a_shared_prefix_workload_than_vllms_pool():
    """Why an SGLang prefill fleet hits less than a vLLM one under the same routing
    (docs/benchmarks.md, P/D): SGLang evicts whole radix nodes, so making room for one
    prompt can drop a whole system prompt and leave most of it free, where vLLM's pool
    evicts block by block. The same requests, one at a time, on the same cache size."""
    rng = random.Random(7)
    systems = [[rng.randrange(1000, 30000) for _ in range(60)] for _ in range(6)]
    order = [group for group in range(6) for _ in range(12)]
    rng.shuffle(order)
    prompts = [systems[g] + [rng.randrange(1000, 30000) for _ in range(8)] for g in order]
    figures = {}
    for name, core in (("sglang", make_core(64, 4)), ("vllm", make_vllm_core(64, 4))):
        hits, cached_pages = 0, []
        for n, prompt in enumerate(prompts):
            req = SimRequest(str(n), prompt, 1)
            core.add(req)
            drain(core)
            hits += req.num_cached_tokens
            cached_pages.append(len(core.kv.cached_digests()))
        warm = cached_pages[len(prompts) // 4 :]
        figures[name] = (hits / sum(map(len, prompts)), sum(warm) / len(warm))
    (sglang_hit, sglang_held), (vllm_hit, vllm_held) = figures["sglang"], figures["vllm"]
    assert vllm_held >= 62  # vLLM's pool stays full of cached blocks (63 usable)
    assert sglang_held <= vllm_held - 6  # SGLang's tree leaves pages free after evicting
    assert sglang_hit <= vllm_hit - 0.05


def test_a_disabled_tree_shares_nothing_publishes_nothing_and_frees_every_page():
    """SGLang's P/D decode default (``disable_radix_cache`` resolved true): the same
    prompt twice hits nothing, no KV event is recorded, a request's pages go back when
    it ends, and a flush publishes no ``AllBlocksCleared``; the enabled tree, beside it,
    hits and publishes."""
    limits = CoreLimits(4, 64, 8, max_model_len=1 << 16)
    off = EngineCore(
        limits, SglangSha256Hasher(), TimingModel(), SglangRadixCache(64, 4, disable=True)
    )
    on = make_core(num_pages=64, page_size=4)
    prompt = list(range(200, 230))
    for core in (off, on):
        for name in ("a", "b"):
            core.add(SimRequest(name, prompt, 3))
            drain(core)
    second_off, second_on = SimRequest("c", prompt, 1), SimRequest("c", prompt, 1)
    assert off.kv.cached_prefix_tokens(second_off) == 0
    assert on.kv.cached_prefix_tokens(second_on) == 28  # 7 whole pages of 29 tokens
    for core, req in ((off, second_off), (on, second_on)):
        core.add(req)
        drain(core)
    assert (second_off.num_cached_tokens, second_on.num_cached_tokens) == (0, 28)
    assert off.kv.take_events() == [] and stored_tokens(on)
    assert off.kv.num_free == 64 and off.kv.usage == 0.0 and off.kv.cached_digests() == set()
    assert off.kv.clear() and off.kv.take_events() == []
