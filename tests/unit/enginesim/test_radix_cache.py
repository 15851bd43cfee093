"""What a client or a sidecar sees of SGLang mode's cache, where it differs from vLLM's
(the full semantics are held to SGLang's source in ``test_sglang_cache_differential.py``)."""

from __future__ import annotations

import pytest

from enginesim.errors import RequestRejected
from enginesim.hashing import SglangSha256Hasher
from enginesim.kv_manager import BlockEvicted, BlocksStored
from enginesim.radix_cache import SglangRadixCache
from enginesim.scheduler import CoreLimits, EngineCore, SimRequest
from enginesim.timing import TimingModel


def make_core(num_pages: int = 256, page_size: int = 1, max_running: int = 8) -> EngineCore:
    limits = CoreLimits(page_size, num_pages, max_running, max_model_len=1 << 16)
    cache = SglangRadixCache(num_pages, page_size)
    return EngineCore(limits, SglangSha256Hasher(), TimingModel(), cache)


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
