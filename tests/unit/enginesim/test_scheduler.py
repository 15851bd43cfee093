"""The engine core: prefix hits, eviction, batching limits, and events that mirror the pool."""

from __future__ import annotations

from collections import Counter

import pytest

from enginesim.blockpool import BlockPool, VllmKVCacheManager
from enginesim.errors import PoolExhausted, RequestRejected
from enginesim.hashing import VllmSha256CborHasher, prompt_digests
from enginesim.kv_manager import AllCleared, BlockEvicted, BlocksStored
from enginesim.request import LoadedKV, SimRequest
from enginesim.scheduler import CoreLimits, EngineCore
from enginesim.timing import TimingModel

BS = 16


def make_core(num_blocks: int = 1024, max_num_seqs: int = 8, max_model_len: int = 8192):
    limits = CoreLimits(BS, num_blocks, max_num_seqs, max_model_len)
    kv = VllmKVCacheManager(num_blocks, BS)
    return EngineCore(limits, VllmSha256CborHasher(), TimingModel(), kv)


class Mirror:
    """What a subscriber holds after applying every event the engine emitted, counting
    copies: vLLM caches (and publishes) a block computed again under a cached hash as a
    second copy, and publishes the removal of each copy."""

    def __init__(self) -> None:
        self.copies: Counter[bytes] = Counter()
        self.stored = 0
        self.removed = 0

    @property
    def held(self) -> set[bytes]:
        return set(self.copies)

    def apply(self, core: EngineCore) -> None:
        for event in core.kv.take_events():
            if isinstance(event, BlocksStored):
                assert event.parent is None or event.parent in self.copies
                self.copies.update(event.digests)
                self.stored += len(event.digests)
            elif isinstance(event, BlockEvicted):
                assert self.copies[event.digest] > 0
                self.copies[event.digest] -= 1
                self.copies += Counter()  # drop the zeros
                self.removed += 1
            else:
                assert isinstance(event, AllCleared)
                self.copies.clear()


def run(core: EngineCore, *reqs: SimRequest, mirror: Mirror | None = None) -> None:
    for req in reqs:
        core.add(req)
    for _ in range(10_000):
        if not core.has_work:
            return
        core.step()
        if mirror is not None:
            mirror.apply(core)
            assert mirror.held == core.kv.cached_digests()
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
    assert mirror.held == core.kv.cached_digests()
    assert len(mirror.held) <= 12


def test_decode_fills_blocks_that_get_cached() -> None:
    core = make_core()
    r = req("a", list(range(16)), max_tokens=33)
    run(core, r)
    # 16 prompt tokens + 32 computed output tokens = 3 full blocks
    assert len(core.kv.cached_digests()) == 3
    full = prompt_digests(core.hasher, [*r.prompt, *r.output], BS, None)
    assert set(full[:3]) == core.kv.cached_digests()


def test_lru_evicts_oldest_free_blocks_and_tails_first() -> None:
    core = make_core(num_blocks=9)  # 8 usable: block 0 is vLLM's null block
    old, new = req("old", list(range(64)), 1), req("new", list(range(100, 164)), 1)
    run(core, old)
    run(core, new)
    # the next request needs 3 blocks: the 3 oldest free cached blocks go, old's tail first
    run(core, req("x", list(range(500, 540)), 1))
    old_digests = prompt_digests(core.hasher, old.prompt, BS, None)
    cached = core.kv.cached_digests()
    assert old_digests[0] in cached
    assert not set(old_digests[1:]) & cached
    assert set(prompt_digests(core.hasher, new.prompt, BS, None)) <= cached


def test_a_request_that_cannot_grow_preempts_the_last_running_one() -> None:
    core = make_core(num_blocks=11)  # 10 usable
    big = req("big", list(range(128)), max_tokens=30)  # 8 blocks, 10 at its longest
    small = req("small", list(range(900, 932)), max_tokens=20)  # 2 blocks, then 3
    core.add(big)
    core.add(small)
    core.step()
    assert core.running == [big, small]  # blocks are allocated as tokens come, not ahead
    preempted = []
    while not big.finished:
        preempted += core.step().preempted
    assert preempted == [small] and small.num_preemptions == 1
    assert not small.finished and len(small.output) < small.max_tokens
    run(core)
    assert small.finished and small.output == list(core.filler[:20])
    assert small.num_cached_tokens == 0  # what clients see: its first admission's hit


def test_freed_blocks_go_tail_first_cached_ones_last_and_hashless_ones_first() -> None:
    pool = BlockPool(num_blocks=5, block_size=BS)  # free queue [1, 2, 3, 4]
    blocks = pool.allocate(3)
    digests = prompt_digests(VllmSha256CborHasher(), list(range(32)), BS, None)
    pool.cache_run(blocks[:2], digests, None, list(range(32)), None)
    pool.free(blocks)
    assert pool.free_block_ids() == [3, 4, 2, 1]


def test_a_block_aligned_prompt_sent_twice_caches_its_last_block_twice() -> None:
    core, mirror = make_core(), Mirror()
    prompt = list(range(64))
    run(core, req("a", prompt, 1), mirror=mirror)
    again = req("b", prompt, 1)
    run(core, again, mirror=mirror)
    assert again.num_cached_tokens == 48  # the last block is recomputed into a new block
    last = prompt_digests(core.hasher, prompt, BS, None)[-1]
    assert (mirror.stored, mirror.copies[last]) == (5, 2)


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
    assert not core.kv.clear()
    run(core)
    assert core.kv.clear()
    assert core.kv.cached_digests() == set()
    assert isinstance(core.kv.take_events()[-1], AllCleared)


def test_same_new_prefix_admitted_together_is_stored_once() -> None:
    core, mirror = make_core(), Mirror()
    prompt = list(range(70))
    run(core, req("a", prompt), req("b", [*prompt, 5]), mirror=mirror)
    assert mirror.stored == len(core.kv.cached_digests())


def test_prefill_time_shrinks_with_cache_hits() -> None:
    core = make_core()
    prefix = list(range(2000))
    core.add(req("a", [*prefix, 1]))
    cold = core.step().duration
    run(core)
    core.add(req("b", [*prefix, 2]))
    warm = core.step().duration
    assert cold - warm == pytest.approx(2000 / TimingModel().prefill_rate)


@pytest.mark.parametrize(
    ("loaded", "cached", "computed"),
    [
        # vLLM: every prompt token read, the last computed again; its answer reports 802
        (LoadedKV(803, last_recomputed=True), 802, 1),
        # SGLang: every token read, none computed; its answer reports its prefill's hit
        (LoadedKV(803, last_recomputed=False, reported=160), 160, 0),
    ],
)
def test_a_decode_whose_prompt_was_read_computes_and_reports_as_its_engine(
    loaded: LoadedKV, cached: int, computed: int
) -> None:
    core = make_core()
    decode = req("d", list(range(803)))
    decode.loaded = loaded
    core.add(decode)
    step = core.step()
    assert decode.num_cached_tokens == cached
    assert step.duration == pytest.approx(TimingModel().prefill_seconds(803, 803 - computed))


def test_restart_drops_requests_and_cache() -> None:
    core = make_core()
    run(core, req("a", list(range(64))))
    core.add(req("b", list(range(64))))
    dropped = core.restart()
    assert [r.request_id for r in dropped] == ["b"]
    assert core.kv.cached_digests() == set() and core.kv.take_events() == []


def test_pool_refuses_to_hand_out_blocks_it_does_not_have() -> None:
    pool = BlockPool(num_blocks=3, block_size=16)  # block 0 is the null block
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
    assert mirror.stored == 4 == len(core.kv.cached_digests())


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
