"""The engine core: prefix hits, eviction, batching limits, and events that mirror the pool."""

from __future__ import annotations

import pytest

from enginesim.blockpool import AllCleared, BlockEvicted, BlocksStored
from enginesim.errors import RequestRejected
from enginesim.hashing import VllmSha256CborHasher, prompt_digests
from enginesim.scheduler import CoreLimits, EngineCore, SimRequest
from enginesim.timing import TimingModel

BS = 16


def make_core(num_blocks: int = 1024, max_num_seqs: int = 8, max_model_len: int = 8192):
    limits = CoreLimits(BS, num_blocks, max_num_seqs, max_model_len)
    return EngineCore(limits, VllmSha256CborHasher(), TimingModel())


class Mirror:
    """What a subscriber holds after applying every event the pool emitted."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.stored = 0
        self.removed = 0

    def apply(self, core: EngineCore) -> None:
        for event in core.pool.take_events():
            if isinstance(event, BlocksStored):
                assert not self.held & set(event.digests), "a block was stored twice"
                assert event.parent is None or event.parent in self.held
                self.held.update(event.digests)
                self.stored += len(event.digests)
            elif isinstance(event, BlockEvicted):
                self.held.remove(event.digest)
                self.removed += 1
            else:
                assert isinstance(event, AllCleared)
                self.held.clear()


def run(core: EngineCore, *reqs: SimRequest, mirror: Mirror | None = None) -> None:
    for req in reqs:
        core.add(req)
    for _ in range(10_000):
        if not core.has_work:
            return
        core.step()
        if mirror is not None:
            mirror.apply(core)
            assert mirror.held == core.pool.cached_digests()
    raise AssertionError("engine did not drain")


def req(name: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None):
    return SimRequest(name, prompt, max_tokens, salt)


def test_second_request_hits_the_shared_2000_token_prefix() -> None:
    core = make_core()
    prefix = list(range(5000, 7000))
    first, second = req("a", [*prefix, 1, 2, 3]), req("b", [*prefix, 7, 8, 9, 10])
    run(core, first)
    run(core, second)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 2000 == 125 * BS


def test_identical_prompt_recomputes_at_least_one_token() -> None:
    core = make_core()
    prompt = list(range(64))
    run(core, req("a", prompt))
    again = req("b", prompt)
    run(core, again)
    assert again.num_cached_tokens == 48  # (64 - 1) // 16 blocks


def test_salts_separate_tenants() -> None:
    core = make_core()
    prompt = list(range(320))
    run(core, req("a", prompt, salt="tenant-a"))
    other, same = req("b", prompt, salt="tenant-b"), req("c", prompt, salt="tenant-a")
    run(core, other)
    run(core, same)
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 304


def test_events_mirror_the_pool_through_eviction() -> None:
    core, mirror = make_core(num_blocks=12), Mirror()
    for i in range(6):
        run(core, req(f"r{i}", list(range(i * 1000, i * 1000 + 64)), max_tokens=20), mirror=mirror)
    assert mirror.removed > 0, "a 12-block pool must evict"
    assert mirror.held == core.pool.cached_digests()
    assert len(mirror.held) <= 12


def test_decode_fills_blocks_that_get_cached() -> None:
    core = make_core()
    r = req("a", list(range(16)), max_tokens=33)
    run(core, r)
    # 16 prompt tokens + 32 computed output tokens = 3 full blocks
    assert len(core.pool.cached_digests()) == 3
    full = prompt_digests(core.hasher, [*r.prompt, *r.output], BS, None)
    assert set(full[:3]) == core.pool.cached_digests()


def test_lru_evicts_oldest_free_blocks_and_tails_first() -> None:
    core = make_core(num_blocks=8)
    old, new = req("old", list(range(64)), 1), req("new", list(range(100, 164)), 1)
    run(core, old)
    run(core, new)
    # the next request needs 3 blocks: the 3 oldest free cached blocks go, old's tail first
    run(core, req("x", list(range(500, 540)), 1))
    old_digests = prompt_digests(core.hasher, old.prompt, BS, None)
    cached = core.pool.cached_digests()
    assert old_digests[0] in cached
    assert not set(old_digests[1:]) & cached
    assert set(prompt_digests(core.hasher, new.prompt, BS, None)) <= cached


def test_running_blocks_are_never_evicted_and_requests_wait() -> None:
    core = make_core(num_blocks=10)
    big = req("big", list(range(128)), max_tokens=30)  # 10 blocks
    core.add(big)
    core.step()
    small = req("small", list(range(900, 916)), max_tokens=2)
    core.add(small)
    for _ in range(29):
        core.step()
        assert small in core.waiting or small.finished
        assert not small.output or big.finished
    run(core)
    assert big.finished and small.finished and small.num_cached_tokens == 0


def test_max_num_seqs_bounds_the_batch() -> None:
    core = make_core(max_num_seqs=2)
    for i in range(5):
        core.add(req(f"r{i}", list(range(i * 100, i * 100 + 20)), max_tokens=3))
    core.step()
    assert len(core.running) == 2 and len(core.waiting) == 3


def test_requests_beyond_the_limits_are_rejected() -> None:
    core = make_core(num_blocks=4, max_model_len=100)
    with pytest.raises(RequestRejected, match="maximum context length is 100"):
        core.add(req("long", list(range(99)), max_tokens=2))
    with pytest.raises(RequestRejected, match="KV blocks"):
        core.add(req("big", list(range(80)), max_tokens=2))


def test_clear_cache_is_refused_while_blocks_are_in_use() -> None:
    core = make_core()
    r = req("a", list(range(64)), max_tokens=5)
    core.add(r)
    core.step()
    assert not core.pool.clear_cache()
    run(core)
    assert core.pool.clear_cache()
    assert core.pool.cached_digests() == set()
    assert isinstance(core.pool.take_events()[-1], AllCleared)


def test_same_new_prefix_admitted_together_is_stored_once() -> None:
    core, mirror = make_core(), Mirror()
    prompt = list(range(70))
    run(core, req("a", prompt), req("b", [*prompt, 5]), mirror=mirror)
    assert mirror.stored == len(core.pool.cached_digests())


def test_prefill_time_shrinks_with_cache_hits() -> None:
    core = make_core()
    prefix = list(range(2000))
    core.add(req("a", [*prefix, 1]))
    cold = core.step().duration
    run(core)
    core.add(req("b", [*prefix, 2]))
    warm = core.step().duration
    assert cold - warm == pytest.approx(2000 / TimingModel().prefill_rate)


def test_restart_drops_requests_and_cache() -> None:
    core = make_core()
    run(core, req("a", list(range(64))))
    core.add(req("b", list(range(64))))
    dropped = core.restart()
    assert [r.request_id for r in dropped] == ["b"]
    assert core.pool.cached_digests() == set() and core.pool.take_events() == []


def test_pool_refuses_to_hand_out_blocks_it_does_not_have() -> None:
    from enginesim.blockpool import BlockPool
    from enginesim.errors import PoolExhausted

    pool = BlockPool(num_blocks=2, block_size=16)
    pool.allocate(2)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)


def test_a_request_admitted_with_its_twin_hits_the_blocks_the_twin_allocated() -> None:
    # vLLM v1 caches a request's full blocks when it allocates them, before the forward
    # pass: the n samples of one prompt, admitted in one step, share one prefill.
    core, mirror = make_core(), Mirror()
    prompt = list(range(70))
    first, second = req("0_a", prompt), req("1_a", prompt)
    core.add(first)
    core.add(second)
    step = core.step()
    mirror.apply(core)
    assert step.admitted == [first, second]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 64)
    assert step.duration == pytest.approx(TimingModel().step_seconds([(70, 0), (70, 64)], 0))
    run(core, mirror=mirror)
    assert mirror.stored == 4 == len(core.pool.cached_digests())


def test_a_request_of_no_tokens_is_a_prefill_that_caches_its_prompt_and_ends() -> None:
    core = make_core()
    warm = req("warm", list(range(40)), max_tokens=0)  # SGLang's warm-up of n > 1
    core.add(warm)
    out = core.step()
    assert out.admitted == [warm] and out.finished == [warm] and out.sampled == []
    assert warm.output == [] and warm.finished
    sample = req("sample", list(range(40)), max_tokens=2)
    run(core, sample)
    assert sample.num_cached_tokens == 32  # both full blocks the warm-up cached
