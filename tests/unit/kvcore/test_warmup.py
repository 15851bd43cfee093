"""kvcore.warmup: hot prefixes kept only when shared, the warm-up plan and pace, the gate."""

from __future__ import annotations

import random

from kvcore.keys import chain_keys, root_key
from kvcore.warmup import (
    HotPrefix,
    HotPrefixes,
    Pacer,
    depths,
    moves_it,
    plan,
    settings_of,
    share,
    stagger,
    warming_excluded,
)

BS = 16
ROOT = root_key(model="m")


def _prompt(shared: list[int], rng: random.Random, own_blocks: int = 4) -> list[int]:
    return shared + [rng.randrange(1, 50_000) for _ in range(own_blocks * BS)]


def _observe(hot: HotPrefixes, tokens: list[int], now: float) -> None:
    keys = chain_keys(ROOT, tokens, BS)
    hot.observe("m", keys, lambda: tokens, BS, now)


def test_depths_count_every_block_to_eight_then_four_per_doubling() -> None:
    assert depths(20) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20)
    assert len(depths(512)) <= 32


def test_a_prefix_becomes_hot_only_after_min_requests_distinct_prompts() -> None:
    rng = random.Random(1)
    hot = HotPrefixes(settings_of(enabled=True, min_requests=4))
    system = [rng.randrange(1, 50_000) for _ in range(40 * BS)]
    private = _prompt(system[: 3 * BS], rng)  # one user's prompt, resent many times
    for i in range(200):
        _observe(hot, private, now=i * 0.01)
    assert hot.hot(now=2.0) == [], "a prompt resent by one client is never kept"
    for i in range(200):
        _observe(hot, _prompt(system, rng), now=2.0 + i * 0.01)
    (prefix,) = hot.hot(now=4.0)
    # the deepest counted depth within the shared 40 blocks: 40 itself
    assert prefix.blocks == 40 and list(prefix.tokens) == system
    assert prefix.key == chain_keys(ROOT, system, BS)[-1]
    # a rate over the half-life's window (60 s): 200 requests, 200 * ln 2 / 60 = 2.3 a second
    assert 1.8 < prefix.requests_per_s < 2.4


def test_a_hot_prefix_is_reported_to_its_true_end_between_counted_depths() -> None:
    rng = random.Random(4)
    hot = HotPrefixes(settings_of(enabled=True, min_requests=4))
    system = [rng.randrange(1, 50_000) for _ in range(37 * BS)]  # counted depths: 32, 40
    for i in range(50):
        _observe(hot, _prompt(system, rng), now=i * 0.01)
    (prefix,) = hot.hot(now=1.0)
    assert prefix.blocks == 37 and list(prefix.tokens) == system
    assert prefix.key == chain_keys(ROOT, system, BS)[-1]


def test_prompts_differing_only_in_their_partial_last_block_count_as_distinct() -> None:
    rng = random.Random(5)
    hot = HotPrefixes(settings_of(enabled=True, min_requests=3))
    system = [rng.randrange(1, 50_000) for _ in range(20 * BS)]
    keys = chain_keys(ROOT, system, BS)  # every question shorter than a block
    for question in range(4):  # the first grows one depth, the rest count them all
        hot.observe("m", keys, lambda: system, BS, now=0.0, prompt=hash((keys[-1], question)))
    (prefix,) = hot.hot(now=1.0)
    assert prefix.blocks == 20
    resent = HotPrefixes(settings_of(enabled=True, min_requests=3))
    for _ in range(10):
        resent.observe("m", keys, lambda: system, BS, now=0.0, prompt=7)
    assert resent.hot(now=1.0) == []


def test_memory_stays_bounded_under_unique_prompts() -> None:
    rng = random.Random(2)
    hot = HotPrefixes(settings_of(enabled=True), max_candidates=256)
    for i in range(5000):
        _observe(hot, _prompt([], rng, own_blocks=8), now=i * 0.001)
    assert len(hot) <= 256
    assert hot.hot(now=5.0) == []


def test_hot_prefixes_are_capped_keeping_the_most_requested() -> None:
    rng = random.Random(3)
    settings = settings_of(enabled=True, min_requests=2, max_prefixes=2)
    hot = HotPrefixes(settings)
    groups = [[rng.randrange(1, 50_000) for _ in range(8 * BS)] for _ in range(3)]
    weights = [30, 20, 60]
    now = 0.0
    for group, weight in zip(groups, weights, strict=True):
        for _ in range(weight):
            now += 0.01
            _observe(hot, _prompt(group, rng), now)
    kept = hot.hot(now)
    assert [list(p.tokens) for p in kept] == [groups[2], groups[0]]


def _prefix(blocks: int, rate: float, key: int) -> HotPrefix:
    from array import array

    return HotPrefix("m", key, array("I", range(blocks * BS)), BS, rate)


def test_plan_orders_by_rate_times_uncached_skips_held_and_keeps_the_budget() -> None:
    a, b, c, d = _prefix(10, 5.0, 1), _prefix(40, 2.0, 2), _prefix(20, 1.0, 3), _prefix(8, 9.0, 4)
    held = {1: 0, 2: 10, 3: 20, 4: 0}  # c is held whole
    steps = plan([a, b, c, d], lambda p: held[p.key], max_tokens=50 * BS)
    # values: d 9*128=1152, b 2*480=960, a 5*160=800; c is held whole. Each costs its whole
    # length: d 128 + b 640 = 768 tokens, and a's 160 more would pass the budget of 800
    assert [s.prefix.key for s in steps] == [4, 2]
    assert steps[1].uncached == 30 * BS


def test_replicas_joining_together_start_with_different_prefixes() -> None:
    a, b, c, d, e = (_prefix(10, 10.0 - k, k) for k in range(1, 6))
    steps = plan([a, b, c, d], lambda p: 0, max_tokens=10**6)
    first = stagger(steps, [])
    assert [s.prefix.key for s in first] == [1, 2, 3, 4]  # alone: most valuable first
    # a second joiner starts half a plan on, so until they meet the two hold different
    # prefixes, the most valuable first
    second = stagger(steps, [[1, 2, 3, 4]])
    assert [s.prefix.key for s in second] == [3, 4, 1, 2]
    third = stagger(steps, [[1, 2, 3, 4], [3, 4, 1, 2]])
    assert [s.prefix.key for s in third] == [2, 4, 1, 3]  # what neither sends first
    # a prefix no running warm-up will send goes first (one already sent is not queued)
    more = plan([a, b, c, d, e], lambda p: 0, max_tokens=10**6)
    assert [s.prefix.key for s in stagger(more, [[3, 4]])] == [1, 2, 5, 4, 3]


def test_plan_sends_first_the_prefixes_whose_holders_are_the_most_loaded() -> None:
    """The warm-up unloads the longest queues first: a prefix whose least busy holder has
    20 requests goes before a more valuable one held by an idle replica, and one no other
    replica holds (inf) before both; at equal pressure, by value."""
    a, b, c, d = _prefix(10, 1.0, 1), _prefix(10, 9.0, 2), _prefix(10, 5.0, 3), _prefix(10, 2.0, 4)
    load = {1: 20.0, 2: 0.0, 3: float("inf"), 4: 0.0}
    steps = plan([a, b, c, d], lambda p: 0, 10**6, lambda p: load[p.key])
    assert [s.prefix.key for s in steps] == [3, 1, 2, 4]


def test_replicas_warming_together_each_take_their_share_of_the_traffic() -> None:
    """Two joiners: each warms the prefixes carrying half the requests per second, in
    its staggered order, so together they hold every prefix once; alone, every one."""
    prefixes = [_prefix(10, rate, key) for key, rate in enumerate((4.0, 3.0, 2.0, 1.0), 1)]
    steps = plan(prefixes, lambda p: 0, 10**6)
    assert [s.prefix.key for s in share(steps, 1)] == [1, 2, 3, 4]
    first = share(stagger(steps, []), 2)
    assert [s.prefix.key for s in first] == [1, 2]  # 7 of the 10 requests/s: >= half
    queued = [[s.prefix.key for s in first]]
    second = share(stagger(steps, queued), 2, queued)
    assert [s.prefix.key for s in second] == [3, 4]  # the rest, not a third of first's
    # a third joining while both run: every prefix is sent elsewhere, so its half of theirs
    queued.append([3, 4])
    third = share(stagger(steps, queued), 2, queued)
    assert sum(s.prefix.requests_per_s for s in third) >= 5.0
    assert share([], 3) == []


def test_pacer_keeps_to_tokens_per_second() -> None:
    pacer = Pacer(1000.0, now=0.0)
    now, sent = 0.0, 0
    while now < 10.0:
        wait = pacer.wait_s(300, now)
        now += wait
        pacer.take(300, now)
        sent += 300
    assert sent <= 1000 * 10 + 1000 + 300  # ten seconds' worth plus the first burst


def test_gate_keeps_a_warming_replica_to_its_share_of_new_prefixes() -> None:
    pending = {3: {111}}
    keys = [7, 8, 9]
    # a prefix only another replica holds: never to the warming one (a miss there)
    assert warming_excluded(pending, keys, {0: 2}, share=1.0, draw=0.0) == {3}
    # a new prefix: by the draw against the share
    assert warming_excluded(pending, keys, {}, share=0.25, draw=0.1) == frozenset()
    assert warming_excluded(pending, keys, {}, share=0.25, draw=0.5) == {3}
    # a prefix it is being warmed with, not yet confirmed: never
    assert warming_excluded(pending, [111, 8], {}, share=1.0, draw=0.0) == {3}
    # what its events confirmed it holds: a candidate as any other
    assert warming_excluded(pending, keys, {3: 2, 0: 2}, share=0.0, draw=0.9) == frozenset()
    assert warming_excluded({}, keys, {}, share=0.0, draw=0.9) == frozenset()


def test_a_transfer_moves_unless_its_holders_queue_while_the_warming_replica_is_idle() -> None:
    assert moves_it(0, busy=False) and moves_it(0, busy=True)  # a free slot there: move
    assert not moves_it(3, busy=False)  # every holder queues, the joiner idle: compute
    assert moves_it(3, busy=True)  # the joiner computes or serves already: move anyway
    assert not moves_it(None, busy=True)  # nobody holds it: compute (queued)
