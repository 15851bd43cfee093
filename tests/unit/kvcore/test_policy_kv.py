"""Level 3 strategies: kv_aware's score and kv_cost's predicted time to first token."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.policies import (
    Decision,
    Policy,
    ReplicaState,
    StateView,
    StaticStateView,
    create_policy,
)
from kvcore.policies.kv_aware import KvAwarePolicy
from kvcore.policies.kv_cost import KvCostPolicy
from kvcore.policies.kv_scoring import SPECULATION_TICK_S, PrefixHeat, spread
from kvcore.workload import KvAwareWorkload, KvCostWorkload, Workload
from tests.unit.kvcore.policy_helpers import context, fleet
from tests.unit.kvcore.test_preselect import WholeFleetView

PROMPT = list(range(100, 228))  # eight blocks


def _view(replicas: list[ReplicaState], holders: dict[int, int]) -> StaticStateView:
    """``holders``: ordinal -> how many leading blocks of PROMPT it holds."""
    view = StaticStateView(replicas, residency_known=True)
    keys = context(KvAwareWorkload(), PROMPT).block_keys
    for ordinal, blocks in holders.items():
        view.index.add(ordinal, keys[:blocks])
    return view


def _select(
    workload: Workload,
    view: StaticStateView,
    seed: int = 0,
    tokens: list[int] = PROMPT,
    **ctx: object,
) -> Decision:
    return create_policy(workload, rng=random.Random(seed)).select(
        context(workload, tokens, **ctx), view
    )


def test_kv_aware_scores_with_the_briefs_formula() -> None:
    """The score alone (no imbalance guard: 128 requests against none would trip it)."""
    replicas = [ReplicaState(0, "warm", running=128), ReplicaState(1, "cold")]
    view = _view(replicas, {0: 8})
    decision = _select(KvAwareWorkload(locality_weight=0.5, max_imbalance=None), view)
    rows = {r.replica_id: r for r in decision.reasons}
    assert rows["warm"].hit == 1.0 and rows["warm"].load == 0.5
    assert rows["warm"].score == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)
    assert rows["cold"].score == pytest.approx(0.5)
    assert decision.replica_id == "warm"
    cold = _select(KvAwareWorkload(locality_weight=0.2, max_imbalance=None), view)
    assert cold.replica_id == "cold"


def test_kv_aware_sends_a_request_away_from_a_holder_too_far_ahead_of_the_rest() -> None:
    """SGLang's balance_abs_threshold: the holder of the whole prompt with 65 requests
    more than an idle replica loses the request to it, which is then speculated to hold
    the prompt too; 64 more is still within bounds."""
    keys = context(KvAwareWorkload(), PROMPT).block_keys
    for running, chosen in ((65, "idle"), (64, "holder")):
        replicas = [ReplicaState(0, "holder", running=running), ReplicaState(1, "idle")]
        for view in (_view(replicas, {0: 8}), WholeFleetView(_view(replicas, {0: 8}))):
            decision = _select(KvAwareWorkload(), view)
            assert decision.replica_id == chosen
            if chosen == "idle":
                assert decision.note == (
                    "imbalance: holder had 65 requests, idle 0 (max_imbalance 64)"
                )
                assert decision.speculative is not None
                assert decision.speculative.replica == 1
                assert list(decision.speculative.keys) == list(keys)


def test_one_prefix_shared_by_every_prompt_spreads_instead_of_herding() -> None:
    """A burst of 200 prompts that are mostly one system prompt, held by one replica of
    two: without the guard every request stays on its holder (in flight there, unreported
    to the engine's load yet); with it the other replica takes one, holds the prefix from
    then on, and the loads share the rest."""

    def burst(workload: KvAwareWorkload) -> Counter[str]:
        policy = create_policy(workload, rng=random.Random(7))
        sent: Counter[str] = Counter()
        for _ in range(200):
            in_flight = [ReplicaState(i, f"r{i}", unreported=sent[f"r{i}"]) for i in (0, 1)]
            view = _view(in_flight, {0: 8, 1: 8} if sent["r1"] else {0: 8})  # as speculated
            decision = policy.select(context(workload, PROMPT), view)
            assert decision.replica_id is not None
            sent[decision.replica_id] += 1
        return sent

    assert burst(KvAwareWorkload(max_imbalance=None, hot_prefix_gap=None)) == Counter({"r0": 200})
    for guard in (KvAwareWorkload(hot_prefix_gap=None), KvAwareWorkload(max_imbalance=None)):
        spread = burst(guard)  # either guard alone: max_imbalance, or the hot prefix's
        assert spread["r1"] >= 90 and spread["r0"] >= 90


def test_a_decision_summarises_itself_for_a_debug_header() -> None:
    replicas = [ReplicaState(0, "warm", running=128), ReplicaState(1, "cold")]
    workload = KvAwareWorkload(locality_weight=0.5, max_imbalance=None)
    decision = _select(workload, _view(replicas, {0: 8}))
    assert decision.summary() == (
        "replica=warm; strategy=kv_aware; hit=1.000; load=0.500; score=0.750"
    )
    empty = _select(KvAwareWorkload(), _view([], {}))
    assert empty.summary().startswith("replica=-; strategy=kv_aware; note=")


def test_kv_aware_prefers_the_longest_leading_run_at_equal_load() -> None:
    view = _view(fleet(3), {0: 2, 1: 6, 2: 4})
    decision = _select(KvAwareWorkload(), view)
    assert decision.replica_id == "r1"
    assert [r.hit_blocks for r in decision.reasons] == [2, 6, 4]


def test_kv_aware_skips_a_holder_whose_queue_is_over_the_threshold() -> None:
    replicas = [ReplicaState(0, "hot", running=200, waiting=40), ReplicaState(1, "cool")]
    decision = _select(KvAwareWorkload(load_threshold=0.9), _view(replicas, {0: 8}))
    assert decision.replica_id == "cool"
    assert decision.reasons[0].excluded == "queue load 0.938 >= load_threshold 0.9"


@pytest.mark.parametrize(
    "workload", [KvAwareWorkload(), KvCostWorkload()], ids=["kv_aware", "kv_cost"]
)
def test_a_full_kv_cache_with_an_empty_queue_still_gets_its_prefixs_requests(
    workload: Workload,
) -> None:
    """A busy engine keeps its KV cache nearly full of the prefixes it serves; that is
    no reason to recompute a prefix elsewhere while it admits requests at once."""
    replicas = [
        ReplicaState(0, "holder", running=12, kv_usage=0.97),
        ReplicaState(1, "other", running=12, kv_usage=0.60),
    ]
    decision = _select(workload, _view(replicas, {0: 8}))
    assert decision.replica_id == "holder"
    assert all(row.excluded is None for row in decision.reasons)


def test_kv_aware_takes_a_full_kv_cache_with_requests_waiting_as_saturated() -> None:
    """Full of running requests and some already waiting: the engine cannot admit more."""
    replicas = [
        ReplicaState(0, "holder", running=12, waiting=2, kv_usage=0.97),
        ReplicaState(1, "other", running=12, kv_usage=0.97),
    ]
    decision = _select(KvAwareWorkload(), _view(replicas, {0: 8}))
    assert decision.replica_id == "other"
    assert decision.reasons[0].excluded == (
        "KV usage 0.970 >= load_threshold 0.9 with 2 requests waiting"
    )


def test_kv_cost_counts_a_full_kv_cache_with_requests_waiting_as_their_wait() -> None:
    """kv_cost puts the requests waiting for KV room in the wait, where kv_aware screens
    the replica out: a busy engine serving long prompts runs full with a queue most of
    the time, and screening on a load report up to a heartbeat old sent the prefixes
    away from their holders (RAG in bench sim: 36% hit and 0.53 s mean TTFT counted so,
    32% and 3.5 s screened). A short wait keeps the prefix's requests; a long one sends
    them where they are served sooner."""
    prompt = list(range(2048))  # 128 blocks: 0.2 s of prefill at 10,000 tokens/s
    keys = context(KvCostWorkload(), prompt).block_keys

    def choose(waiting: int) -> Decision:
        holder = ReplicaState(0, "holder", running=12, waiting=waiting, kv_usage=0.97)
        view = StaticStateView(
            [holder, ReplicaState(1, "other", running=12, kv_usage=0.97)], residency_known=True
        )
        view.index.add(0, keys)
        return _select(KvCostWorkload(), view, tokens=prompt)

    decision = choose(waiting=2)  # 2 x 1,024 tokens queued: 0.2 s, weighed 0.2
    assert decision.replica_id == "holder"
    assert all(row.excluded is None for row in decision.reasons)
    assert choose(waiting=40).replica_id == "other"  # 4.1 s queued


def test_kv_aware_ties_go_to_the_lower_load_then_at_random() -> None:
    # score(a) = 0.5 * 0.5 + 0.5 * (1 - 0.5) == score(b) = 0 + 0.5 * 1
    replicas = [ReplicaState(0, "a", running=128), ReplicaState(1, "b")]
    workload = KvAwareWorkload(locality_weight=0.5)
    assert _select(workload, _view(replicas, {0: 4})).replica_id == "b"
    even = _view(fleet(2), {0: 4, 1: 4})
    picks = Counter(_select(workload, even, seed=s).replica_id for s in range(40))
    assert set(picks) == {"r0", "r1"}
    assert _select(workload, even, seed=3).replica_id == _select(workload, even, seed=3).replica_id


def test_speculative_residency_expires_at_the_first_tick_after_its_ttl() -> None:
    """Rounded up to 1/64 s, so that a busy proxy's records of one tick coalesce: never
    sooner than the TTL, at most a tick later."""
    workload = KvAwareWorkload(speculative_ttl_s=2.0)
    view = _view(fleet(2), {})
    view.index.add(1, [12345])
    for now in (100.0, 100.001, 100.0156, 100.015625, 7.3):
        record = _select(workload, view, seed=1, now=now).speculative
        assert record is not None
        assert now + 2.0 <= record.expires_at < now + 2.0 + SPECULATION_TICK_S
        assert (record.expires_at * 64).is_integer()


def test_kv_aware_records_speculative_residency_that_steers_the_next_burst() -> None:
    workload = KvAwareWorkload(speculative_ttl_s=5.0)
    view = _view(fleet(4), {})
    view.index.add(3, [12345])  # residency exists, but not for this prompt
    first = _select(workload, view, seed=1, now=100.0)
    assert first.speculative is not None
    assert first.speculative.replica == first.ordinal
    assert first.speculative.expires_at == 105.0
    assert list(first.speculative.keys) == list(context(workload, PROMPT).block_keys)
    view.apply(first)
    burst = {_select(workload, view, seed=s, now=101.0).replica_id for s in range(10)}
    assert burst == {first.replica_id}
    later = {_select(workload, view, seed=s, now=106.0).replica_id for s in range(20)}
    assert len(later) > 1  # expired: back to load and chance


@pytest.mark.parametrize(
    "workload",
    [KvAwareWorkload(fallback="round_robin"), KvCostWorkload(fallback="round_robin")],
    ids=["kv_aware", "kv_cost"],
)
def test_kv_strategies_fall_back_without_residency_data(workload: Workload) -> None:
    replicas = [ReplicaState(0, "a", running=5), ReplicaState(1, "b", running=1)]
    decisions = [_select(workload, StaticStateView(replicas), seed=s) for s in range(4)]
    fallback = workload.fallback  # type: ignore[union-attr]
    for decision in decisions:
        assert decision.strategy == workload.strategy
        assert decision.note.startswith(f"no residency data: fallback {fallback}")
        assert decision.speculative is not None
        assert decision.speculative.replica == decision.ordinal
    if fallback == "least_load":
        assert {d.replica_id for d in decisions} == {"b"}


def test_kv_aware_places_new_prompts_in_turn_not_by_stale_load_on_a_cold_start() -> None:
    """With a least_load fallback, kv_aware's own new-prompt rule places prompts before
    the first engine event: least_load ranked them by the previous phase's loads and sent
    every one to the replica that last reported least."""
    replicas = [ReplicaState(0, "a", running=5), ReplicaState(1, "b", running=1)]
    workload = KvAwareWorkload(fallback="least_load")
    policy = create_policy(workload, rng=random.Random(0))
    view = StaticStateView(replicas)
    chosen = []
    for group in range(4):
        tokens = [group * 1000 + t for t in range(128)]
        decision = policy.select(context(workload, tokens, now=1.0), view)
        view.apply(decision)
        assert decision.note.startswith("no residency data: fallback kv_aware's new-prompt")
        chosen.append(decision.replica_id)
    assert Counter(chosen) == {"a": 2, "b": 2}, chosen


def test_routers_placed_behind_a_balancer_start_their_turns_spread_round_the_fleet() -> None:
    """Four routers behind a round-robin balancer, each seeing only its own sends, each
    taking every fourth new prompt: their turns advance in step, so with random starts
    two of them sent each new prompt to the same replica at the same moment in most
    fleets (bench sim's shared_prefix_4_routers, seed 1). Placed 0-3 they start at
    replicas 0, 4, 2 and 6 and together take the fleet's replicas in turn, whatever
    their random generators."""
    assert [spread(i) for i in range(8)] == [0, 0.5, 0.25, 0.75, 0.125, 0.625, 0.375, 0.875]
    for strategy in (KvCostWorkload(), KvAwareWorkload()):
        for seed in range(20):
            routers = [
                (create_policy(strategy, rng=random.Random(seed * 4 + i), place=i),
                 StaticStateView(fleet(8), residency_known=True))
                for i in range(4)
            ]  # fmt: skip
            chosen = []
            for group in range(16):
                policy, view = routers[group % 4]
                tokens = [group * 1000 + t for t in range(128)]
                decision = policy.select(context(strategy, tokens, now=1.0), view)
                view.apply(decision)
                chosen.append(decision.ordinal)
            assert chosen[:4] == [0, 4, 2, 6]
            assert sorted(chosen[:8]) == list(range(8)) and sorted(chosen[8:]) == list(range(8))


def test_kv_aware_prefix_hash_fallback_keeps_locality_on_a_cold_start() -> None:
    workload = KvAwareWorkload(fallback="prefix_hash", prefix_tokens=64)
    view = StaticStateView(fleet(6))
    picks = {_select(workload, view, seed=s).replica_id for s in range(10)}
    assert len(picks) == 1


def test_kv_cost_predicts_time_to_first_token() -> None:
    """At alpha 0.5, with nothing else waiting, kv_cost ranks by the plain predicted
    time to first token, and its reasons give each replica's wait, prefill, rate and
    the prefill's weight (what the explain endpoint shows)."""
    workload = KvCostWorkload(locality_weight=0.5, prefill_tokens_per_s=1000)
    replicas = [ReplicaState(0, "warm", unreported=2), ReplicaState(1, "cold")]
    view = _view(replicas, {0: 6})
    policy = create_policy(workload)
    assert isinstance(policy, KvCostPolicy)
    ctx = context(workload, PROMPT)
    # warm: (2 queued x 1024 + (128 - 96) uncached) / 1000; cold: 128 / 1000
    assert policy.predicted_ttft_s(ctx, replicas[0], 6) == pytest.approx(2.08)
    assert policy.predicted_ttft_s(ctx, replicas[1], 0) == pytest.approx(0.128)
    decision = policy.select(ctx, view)
    assert decision.replica_id == "cold"
    warm = decision.reasons[0]
    assert warm.score == pytest.approx(-2.08 / 2)  # half the wait, half the prefill
    assert (warm.wait_s, warm.prefill_s) == (pytest.approx(2.048), pytest.approx(0.032))
    assert warm.to_dict()["prefill_tokens_per_s"] == 1000
    assert warm.to_dict()["prefill_weight"] == 0.5


def test_kv_cost_weighs_a_recomputed_second_more_as_the_fleet_queues() -> None:
    """A second of prefill is also a second for each request queued behind it: with the
    engines reporting requests waiting, the prefill weighs ``alpha * (1 + waiting per
    replica)``. Replica 0 holds the prompt with 0.52 s queued; replica 1 would recompute
    it (0.128 s). With nothing waiting the cold one costs less (0.8 * 0.128 = 0.1024 s
    against 0.2 * 0.52 = 0.104 s); four requests waiting on each replica make the
    recomputed second weigh five times as much, and the cache wins."""
    rates = {"prefill_tokens_per_s": 1000}
    idle = [ReplicaState(0, "warm", queued_prefill_tokens=520), ReplicaState(1, "cold")]
    assert _select(KvCostWorkload(**rates), _view(idle, {0: 8})).replica_id == "cold"
    queued = [
        ReplicaState(0, "warm", waiting=4, queued_prefill_tokens=520),
        ReplicaState(1, "cold", waiting=4),
    ]
    decision = _select(KvCostWorkload(**rates), _view(queued, {0: 8}))
    assert decision.replica_id == "warm"
    assert [row.prefill_weight for row in decision.reasons] == [pytest.approx(4.0)] * 2


def test_kv_cost_weighs_the_queues_of_the_replicas_it_may_choose_not_the_excluded() -> None:
    """A P/D prefill is chosen among the prefill replicas, the decode ones excluded; their
    requests waiting (a decode's wait for its KV to arrive) are no queue a recomputed
    prefill would lengthen. As above, the warm replica holds the prompt with 0.52 s
    queued and the cold one would recompute it (0.128 s): with the prefill replicas
    reporting nothing waiting the cold one costs less, whatever three excluded decode
    replicas report (counted, their 4 waiting each made the median 4 and the warm one
    win)."""
    rates = {"prefill_tokens_per_s": 1000}
    replicas = [
        ReplicaState(0, "warm", queued_prefill_tokens=520),
        ReplicaState(1, "cold"),
        *(ReplicaState(i, f"decode-{i}", waiting=4) for i in (2, 3, 4)),
    ]
    decision = _select(
        KvCostWorkload(**rates), _view(replicas, {0: 8}), exclude=frozenset({2, 3, 4})
    )
    assert decision.replica_id == "cold"
    rows = [row for row in decision.reasons if row.replica_id in ("warm", "cold")]
    assert [row.prefill_weight for row in rows] == [pytest.approx(0.8)] * 2


def test_kv_cost_weighs_a_recomputed_second_against_queued_ones_by_alpha() -> None:
    """Replica 0 holds the prompt but has 0.3 s of prefill queued; replica 1 is idle and
    would recompute it all (0.128 s). By the plain prediction (alpha 0.5) the idle one is
    sooner; at the default 0.8 a recomputed second weighs four queued ones (a miss also
    delays whatever queues behind it), and the cache wins."""
    replicas = [ReplicaState(0, "warm", queued_prefill_tokens=300), ReplicaState(1, "cold")]
    rates = {"prefill_tokens_per_s": 1000}
    view = _view(replicas, {0: 8})
    assert _select(KvCostWorkload(locality_weight=0.5, **rates), view).replica_id == "cold"
    assert _select(KvCostWorkload(**rates), view).replica_id == "warm"


def test_kv_cost_takes_the_hit_when_the_queue_is_short() -> None:
    workload = KvCostWorkload(locality_weight=0.5)
    replicas = [
        ReplicaState(0, "warm", queued_prefill_tokens=50, prefill_tokens_per_s=1000),
        ReplicaState(1, "cold", prefill_tokens_per_s=1000),
    ]
    assert _select(workload, _view(replicas, {0: 8})).replica_id == "warm"  # 0.05 s < 0.128 s


def test_kv_cost_locality_weight_zero_ignores_the_cache() -> None:
    replicas = [ReplicaState(0, "warm", queued_prefill_tokens=10), ReplicaState(1, "cold")]
    view = _view(replicas, {0: 8})
    assert _select(KvCostWorkload(locality_weight=0.0), view).replica_id == "cold"
    assert _select(KvCostWorkload(locality_weight=1.0), view).replica_id == "warm"


def test_kv_cost_sends_a_replica_ten_times_slower_its_share_of_new_prompts() -> None:
    """New prompts (no replica holds them) go round in turn; a replica ranked ten times
    slower than the other three takes the turn in proportion to its speed, one prompt in
    31, where kv_aware (no rates) gives every replica a quarter."""
    replicas = [
        ReplicaState(i, f"r{i}", prefill_tokens_per_s=1_000.0 if i == 3 else 10_000.0)
        for i in range(4)
    ]
    view = StaticStateView(replicas, residency_known=True)
    view.index.add(0, [1])  # some residency exists: no cold start
    counts: dict[str, Counter[str]] = {}
    for workload in (KvCostWorkload(), KvAwareWorkload()):
        policy = create_policy(workload, rng=random.Random(1))
        counts[workload.strategy] = Counter(
            policy.select(
                context(workload, [10_000 + 64 * k + j for j in range(64)]), view
            ).replica_id
            for k in range(310)
        )
    assert counts["kv_cost"]["r3"] == 10
    assert sorted(counts["kv_cost"].values())[1:] == [100, 100, 100]
    assert counts["kv_aware"]["r3"] in (77, 78)


def test_kv_cost_uses_each_replicas_own_prefill_rate() -> None:
    replicas = [
        ReplicaState(0, "slow", prefill_tokens_per_s=100),
        ReplicaState(1, "fast", prefill_tokens_per_s=10_000),
    ]
    assert _select(KvCostWorkload(), _view(replicas, {})).replica_id == "fast"


@pytest.mark.parametrize(
    "workload", [KvAwareWorkload(), KvCostWorkload()], ids=["kv_aware", "kv_cost"]
)
def test_a_hot_prefix_shared_by_every_prompt_does_not_pull_all_traffic(workload: Workload) -> None:
    """Every prompt shares block 0 and then differs; requests finish after 12 arrivals."""
    policy = create_policy(workload, rng=random.Random(5))
    view = StaticStateView(fleet(4, capacity=64), residency_known=True)
    inflight: Counter[int] = Counter()
    running: deque[int] = deque()
    chosen: Counter[str] = Counter()
    for i in range(240):
        tokens = list(range(16)) + [50_000 + 64 * i + j for j in range(48)]
        view.set_replicas(
            [ReplicaState(o, f"r{o}", capacity=64, unreported=inflight[o]) for o in range(4)]
        )
        ctx = context(workload, tokens, now=i * 0.01)
        decision = policy.select(ctx, view)
        assert decision.ordinal is not None
        view.apply(decision)
        view.index.add(decision.ordinal, ctx.block_keys)  # the engine confirms
        chosen[decision.replica_id or ""] += 1
        inflight[decision.ordinal] += 1
        running.append(decision.ordinal)
        if len(running) > 12:
            inflight[running.popleft()] -= 1
    assert len(chosen) == 4
    assert min(chosen.values()) >= 240 * 0.15, chosen


def test_a_long_shared_prefix_still_wins_over_a_slightly_less_loaded_replica() -> None:
    replicas = [ReplicaState(0, "warm", running=10), ReplicaState(1, "cold", running=2)]
    view = _view(replicas, {0: 7})
    assert _select(KvAwareWorkload(), view).replica_id == "warm"
    assert _select(KvCostWorkload(), view).replica_id == "warm"  # running work is not queued


def test_without_the_min_hit_guard_a_hot_prefix_would_pull_everything() -> None:
    view = StaticStateView(fleet(4), residency_known=True)
    hot = list(range(16))
    guarded, unguarded = KvAwareWorkload(), KvAwareWorkload(min_hit=0.0)
    view.index.add(0, context(guarded, hot).block_keys)
    tokens = hot + list(range(500, 548))
    assert _select(unguarded, view, seed=1, tokens=tokens).replica_id == "r0"
    assert {_select(guarded, view, seed=s, tokens=tokens).replica_id for s in range(20)} == {
        "r0",
        "r1",
        "r2",
        "r3",
    }


@pytest.mark.parametrize(
    "workload", [KvAwareWorkload(), KvCostWorkload()], ids=["kv_aware", "kv_cost"]
)
def test_a_cold_burst_of_one_new_prompt_lands_together(workload: Workload) -> None:
    """No engine event yet: the first request takes the fallback, the rest follow its
    speculative record (before: r3, r1, r0, r1, r1, r2, r0, r2)."""
    policy = create_policy(workload, rng=random.Random(7))
    view = StaticStateView(fleet(4))
    chosen = []
    for i in range(8):
        decision = policy.select(context(workload, PROMPT, now=100.0 + i * 0.01), view)
        view.apply(decision)
        chosen.append(decision.replica_id)
    assert len(set(chosen)) == 1, chosen
    later = policy.select(context(workload, PROMPT, now=100.0 + 2.5), view)
    assert later.note.startswith("no residency data")  # speculation expired: fallback again


def test_a_cold_start_keeps_the_fallback_for_prompts_nobody_holds() -> None:
    """Speculation about one prompt does not turn another new prompt's prefix_hash
    placement into a load pick, so proxies with different speculation agree on it."""
    workload = KvAwareWorkload(fallback="prefix_hash", prefix_tokens=64)
    other = list(range(5000, 5128))
    fresh = _select(workload, StaticStateView(fleet(6)), seed=1, tokens=other)
    busy = StaticStateView(fleet(6))
    busy.apply(_select(workload, busy, seed=2, now=1.0))
    for seed in range(10):
        decision = _select(workload, busy, seed=seed, tokens=other, now=1.5)
        assert decision.replica_id == fresh.replica_id
        assert decision.note.startswith("no residency data: fallback prefix_hash")


@pytest.mark.parametrize("seed", range(8))
def test_kv_aware_spreads_new_prefixes_evenly_whatever_the_cold_start_placed(seed: int) -> None:
    """16 groups' first prompts on 4 replicas, the engines' events arriving after the
    first 6: no replica gets three groups more than another (before, the cold-start
    fallback and the turn placed them blind to each other: in bench.e2e a replica got
    5-6 groups, another 2-3, and the crowded one evicted)."""
    workload = KvAwareWorkload()
    policy = create_policy(workload, rng=random.Random(seed))
    view = StaticStateView(fleet(4))
    placed = _place_groups(policy, view, view, seed, questions=True)
    assert len(placed) == 4 and max(placed.values()) - min(placed.values()) <= 2, placed


@pytest.mark.parametrize("whole_fleet", [False, True], ids=["board", "whole_fleet"])
@pytest.mark.parametrize("seed", range(4))
def test_kv_aware_spreads_a_cold_starts_groups_evenly_whatever_the_stale_loads(
    seed: int, whole_fleet: bool
) -> None:
    """16 groups on 4 replicas whose loads are stale leftovers (0.012, 0, 0.004, 0.008),
    the engines' events arriving after the first 6 groups: 4 groups each, on the board
    and the whole-fleet path alike (before: least_load sent all 7 cold groups to the
    replica that last reported least, 7/3/3/3; bench.e2e saw 4 of its first 6 groups on
    one replica, which then evicted)."""
    workload = KvAwareWorkload()
    policy = create_policy(workload, rng=random.Random(seed))
    usage = [0.012, 0.0, 0.004, 0.008]
    view = StaticStateView([ReplicaState(i, f"r{i}", kv_usage=u) for i, u in enumerate(usage)])
    state = WholeFleetView(view) if whole_fleet else view
    placed = _place_groups(policy, view, state, seed, questions=False)
    assert sorted(placed.values()) == [4, 4, 4, 4], placed


def _place_groups(
    policy: Policy, view: StaticStateView, state: StateView, seed: int, *, questions: bool
) -> Counter[str]:
    """Replicas chosen for 16 groups' first prompts (8 blocks each, plus a block of
    question when ``questions``), in a random order, 50 ms apart; ``view`` (which
    ``state`` reads) gets each decision's speculation and, after the first 6, the
    engine's events for its prompt."""
    workload = KvAwareWorkload()
    placed: Counter[str] = Counter()
    for step, group in enumerate(random.Random(seed).sample(range(16), 16)):
        tokens = [group * 1000 + t for t in range(128)]
        if questions:
            tokens += [90_000 + step * 16 + t for t in range(16)]
        ctx = context(workload, tokens, now=step * 0.05)
        decision = policy.select(ctx, state)
        assert decision.ordinal is not None
        view.apply(decision)
        if step >= 6:
            view.index.add(decision.ordinal, ctx.block_keys)  # the engine's events
        placed[decision.replica_id or ""] += 1
    return placed


@settings(max_examples=200, deadline=None)
@given(
    locality=st.floats(0, 1),
    min_hit=st.floats(0, 1),
    running=st.integers(0, 400),
    kv_usage=st.floats(0, 1),
    unreported=st.integers(0, 50),
    blocks=st.integers(0, 8),
)
def test_kv_awares_score_of_a_replica_holding_nothing_is_its_scores_figure(
    locality: float, min_hit: float, running: int, kv_usage: float, unreported: int, blocks: int
) -> None:
    """The non-holder search ranks by a shortcut of the score: the very same float."""
    workload = KvAwareWorkload(locality_weight=locality, min_hit=min_hit)
    policy = create_policy(workload, rng=random.Random(0))
    assert isinstance(policy, KvAwarePolicy)
    replica = ReplicaState(3, "r3", running=running, kv_usage=kv_usage, unreported=unreported)
    ctx = context(workload, PROMPT[: blocks * 16])
    assert policy.nonholder_score(ctx, replica) == policy.scores(ctx, [replica], {})[3]


@pytest.mark.parametrize("whole_fleet", [False, True], ids=["board", "whole_fleet"])
def test_kv_awares_turn_skips_a_replica_sent_more_than_a_prompt_beyond_the_least_sent(
    whole_fleet: bool,
) -> None:
    """New prompts nobody holds go round in turn, past a replica this router sent more
    than one prompt's worth of blocks beyond the least-sent one lately; within a prompt
    of it, a replica keeps its turn."""
    workload = KvAwareWorkload(speculative_ttl_s=0)  # the decisions add nothing placed
    view = StaticStateView(fleet(3), residency_known=True)
    view.index.add_speculative(1, list(range(1, 10)), expires_at=100.0)  # 9 blocks: past
    view.index.add_speculative(2, list(range(20, 28)), expires_at=100.0)  # 8: within
    policy = create_policy(workload, rng=random.Random(0))
    state = WholeFleetView(view) if whole_fleet else view
    chosen = {
        policy.select(
            context(workload, [50_000 + i * 1000 + t for t in range(128)]), state
        ).replica_id
        for i in range(6)
    }
    assert chosen == {"r0", "r2"}


def _traffic(policy: Policy, workload: Workload, prompts: list[list[int]], n: int) -> None:
    """``n`` requests through ``policy``, cycling over ``prompts``, each on an idle fleet
    where replica 0 holds it (so that the router's recent traffic is theirs)."""
    replicas = [ReplicaState(0, "holder"), ReplicaState(1, "idle")]
    for i in range(n):
        tokens = prompts[i % len(prompts)]
        view = StaticStateView(replicas, residency_known=True)
        view.index.add(0, context(workload, tokens).block_keys)
        assert policy.select(context(workload, tokens, now=1.0 + i / 100), view).replica_id


def _hot_choice(
    prompts: list[list[int]],
    warm_up: int,
    running: int,
    workload: KvAwareWorkload | KvCostWorkload | None = None,
) -> Decision:
    """The decision for PROMPT (held by replica 0 of four, with ``running`` requests;
    the other three idle) after ``warm_up`` requests cycling over ``prompts``."""
    workload = workload or KvAwareWorkload()
    policy = create_policy(workload, rng=random.Random(3))
    _traffic(policy, workload, prompts, warm_up)
    replicas = [ReplicaState(0, "holder", running=running)]
    replicas += [ReplicaState(i, f"idle{i}") for i in (1, 2, 3)]
    return policy.select(
        context(workload, PROMPT, now=1.0 + warm_up / 100), _view(replicas, {0: 8})
    )


def test_a_hot_prefix_goes_to_the_least_busy_replica_past_a_small_gap() -> None:
    """One prefix drawing every request of a busy router would fill every replica's fair
    share: its holder with more than hot_prefix_gap (4) requests beyond an idle replica
    loses the request to it, which is speculated to hold the prompt from then on; 4
    beyond is within the gap, and max_imbalance (64) alone would have kept both."""
    moved = _hot_choice([PROMPT], warm_up=40, running=5)
    assert moved.replica_id == "idle1"  # the least busy: fewest requests, then ordinal
    assert moved.note == (
        "hot prefix (100% of recent requests): holder had 5 requests, idle1 0 (hot_prefix_gap 4)"
    )
    assert moved.speculative is not None and moved.speculative.replica == 1
    assert _hot_choice([PROMPT], warm_up=40, running=4).replica_id == "holder"


def test_a_prefix_among_many_is_not_hot_nor_a_router_just_started() -> None:
    """Eight prefixes sharing the traffic evenly are each an eighth of it, half of one
    replica's fair share on four: the holder keeps it (a replica each would cost the
    caches their room for the others); so does a router with too few requests behind it
    to tell a hot prefix from chance: half of its first 11 requests is two fair shares on
    four replicas, but not less one standard error (55% - 22%), where half of 81 is.
    Every one of 11 requests is hot whatever chance could do (100% - 30%)."""
    others = [[1000 * p + t for t in range(128)] for p in range(1, 8)]
    assert _hot_choice([PROMPT, *others], warm_up=80, running=30).replica_id == "holder"
    half = [PROMPT, others[0]]
    assert _hot_choice(half, warm_up=10, running=30).replica_id == "holder"
    assert _hot_choice(half, warm_up=80, running=30).replica_id == "idle1"
    assert _hot_choice([PROMPT], warm_up=10, running=30).replica_id == "idle1"


def test_kv_cost_spreads_a_prompt_every_request_shares_within_its_first_requests() -> None:
    """A cold start where every request opens with one 2,048-token system prompt, onto 8
    idle replicas, each request sent while those before it still prefill: the first goes
    to one replica, and by the fourth (the first the heat counts the prompt in three of
    four: hot among 8, less the standard error of four requests) another replica takes
    it as a hot prefix. A fixed floor of 16 requests before any share counted kept the
    first 16 on the first holder, queued behind its prefill (bench sim's
    ``one_system_prompt``: 0.2-0.4 s each, where a miss on an idle replica takes
    0.22 s)."""
    workload = KvCostWorkload()
    policy = create_policy(workload, rng=random.Random(3))
    sent: Counter[int] = Counter()
    view = StaticStateView([], residency_known=True)
    prompt = list(range(100, 2148))  # 0.2 s to prefill; 1,024 tokens assumed per request sent
    decisions = []
    for i in range(4):
        view.set_replicas(ReplicaState(o, f"r{o}", unreported=sent[o]) for o in range(8))
        decision = policy.select(context(workload, prompt, now=1.0 + i / 100), view)
        assert decision.ordinal is not None
        view.apply(decision)  # speculated on the replica that takes it, as a proxy does
        sent[decision.ordinal] += 1
        decisions.append(decision)
    assert len(sent) == 2, sent
    moved = next(d for d in decisions if d.ordinal != decisions[0].ordinal)
    assert moved.note.startswith("hot prefix (75% of recent requests)"), moved.note


def test_a_router_among_several_counts_the_fleets_requests_behind_a_share() -> None:
    """Half of ten requests routed is too few to call a prefix hot among four replicas
    for a router that sent all the engines hold (55% of 11, less its standard error, is
    under two fair shares), but one whose own requests in flight are 2 of the holder's
    30 is one of several behind a balancer: its ten stand for about a hundred of the
    fleet's, and the hot prefix moves (each router counting only its own, four routers
    sharing a chat app's system prompt left one replica of four without a request)."""
    workload = KvAwareWorkload()
    replicas = [ReplicaState(0, "holder", running=30)]
    replicas += [ReplicaState(i, f"idle{i}") for i in (1, 2, 3)]
    half = [PROMPT, [1000 + t for t in range(128)]]
    for inflight, expected in ((None, "holder"), (30, "holder"), (2, "idle1")):
        policy = create_policy(workload, rng=random.Random(3))
        _traffic(policy, workload, half, 10)
        view = StaticStateView(replicas, residency_known=True, inflight=inflight)
        view.index.add(0, context(workload, PROMPT).block_keys[:8])
        decision = policy.select(context(workload, PROMPT, now=1.1), view)
        assert decision.replica_id == expected, inflight


SYSTEM = list(range(100, 164))  # a chat app's system prompt: four blocks


def _chat_turn(conversation: int) -> list[int]:
    """A turn of ``conversation``: the system prompt, then its own history (four blocks)."""
    return SYSTEM + [10_000 * (conversation + 1) + t for t in range(64)]


def test_a_system_prompt_under_every_conversations_history_is_hot() -> None:
    """A chat app's follow-ups extend each conversation's own history, held by the
    replica that served it, and every other replica holding the system prompt ends its
    run there: the system prompt is in every request, and hot. Counted only where the
    chosen holder's run ended, it drew a new conversation's turns alone and was never
    hot: behind several proxies the replicas that received it first kept every new
    conversation while a fourth served none. kv_cost (hot_prefix_gap 0) now gives a new
    conversation to an idle replica once the holders have a request more."""
    workload = KvCostWorkload()
    policy = create_policy(workload, rng=random.Random(3))
    two = [ReplicaState(0, "holder"), ReplicaState(1, "other")]
    for i in range(40):  # follow-ups: replica 0 holds the history, replica 1 the prompt
        turn = _chat_turn(i % 5)
        view = StaticStateView(two, residency_known=True)
        keys = context(workload, turn).block_keys
        view.index.add(0, keys)
        view.index.add(1, keys[:4])
        assert policy.select(context(workload, turn, now=1.0 + i / 100), view).replica_id
    fleet = [ReplicaState(0, "holder", running=1), ReplicaState(1, "other", running=1)]
    fleet += [ReplicaState(i, f"idle{i}") for i in (2, 3)]
    view = StaticStateView(fleet, residency_known=True)
    opening = _chat_turn(99)  # a new conversation: only the system prompt is held
    for ordinal in (0, 1):
        view.index.add(ordinal, context(workload, opening).block_keys[:4])
    decision = policy.select(context(workload, opening, now=1.5), view)
    assert decision.replica_id.startswith("idle")
    assert decision.note.startswith("hot prefix (100% of recent requests)"), decision.note


def test_kv_cost_counts_a_hot_prefix_as_held_everywhere_from_one_request_beyond() -> None:
    """kv_cost's hot_prefix_gap is 0: a hot prefix's holder one request busier than an
    idle replica loses the request to it (the cheapest, the prefix counted as held by
    each); kv_aware's gap (4) keeps it."""
    assert _hot_choice([PROMPT], 40, 1, KvCostWorkload()).replica_id.startswith("idle")
    assert _hot_choice([PROMPT], 40, 0, KvCostWorkload()).replica_id == "holder"
    assert _hot_choice([PROMPT], 40, 1, KvAwareWorkload()).replica_id == "holder"


def test_a_prompt_is_hot_on_a_holder_by_its_share_of_the_fleets_speed() -> None:
    """Three prompts share the traffic over three replicas: each fills one replica's fair
    share, and stays with its holder. Held by a replica learned ten times slower (its
    share of the fleet's speed 1/21), a third of the traffic is hot there, and it moves
    to a faster replica (in real processes the slow replica kept its prompt's requests,
    its hits about as quick as a miss elsewhere: 10-14% of them, where 4.8% is its
    share)."""
    workload = KvCostWorkload()
    prompts = [PROMPT, *([1000 * p + t for t in range(128)] for p in (1, 2))]

    def chosen(rate: float | None) -> Decision:
        policy = create_policy(workload, rng=random.Random(3))
        _traffic(policy, workload, prompts, 60)
        fleet = [ReplicaState(0, "holder", running=1, prefill_tokens_per_s=rate)]
        fleet += [ReplicaState(i, f"other{i}") for i in (1, 2)]
        return policy.select(context(workload, PROMPT, now=1.6), _view(fleet, {0: 8}))

    assert chosen(None).replica_id == "holder"
    moved = chosen(1_000.0)
    assert moved.replica_id.startswith("other")
    assert moved.note.startswith("hot prefix (34% of recent requests)"), moved.note


def test_prefix_heat_forgets_by_half_life_and_stays_bounded() -> None:
    heat = PrefixHeat(half_life_s=10.0, keys=64)

    def requests(key: int, start: float, seconds: int) -> None:  # ten a second
        for i in range(seconds * 10):
            assert heat.share(key, start + i / 10) <= 1.0
            heat.routed(start + i / 10)

    requests(1, 0.0, 100)  # key 1 draws every request for 100 s
    assert heat.share(1, 100.0) == pytest.approx(1.0)
    heat.routed(100.0)
    requests(2, 100.1, 30)  # then key 2 alone for 30 s: three half-lives
    assert heat.share(2, 130.1) == pytest.approx(7 / 8, abs=0.02)
    assert heat.share(1, 130.1) == pytest.approx(1 / 8, abs=0.02)
    for key in range(1000, 1500):  # many cold prefixes: memory stays bounded
        heat.share(key, 130.2)
    assert len(heat) <= 64
    assert heat.share(2, 130.2) > 0.8  # the hot one was kept


def test_a_router_with_a_request_or_so_a_second_has_about_15_behind_it() -> None:
    """One request a second, with a 10 s half-life, is about 15 routed lately: fewer
    than the 16 a share must have behind it when this router is the only one."""
    heat = PrefixHeat(half_life_s=10.0)
    for i in range(100):
        heat.share(1, float(i))
        heat.routed(float(i))
    assert heat.share(1, 100.0) == pytest.approx(1.0)
    assert heat.lately(100.0) == pytest.approx(1 / (1 - 2 ** (-1 / 10)), rel=0.01)
    assert heat.lately(100.0) < 16


def test_kv_cost_spreads_a_hot_prefix_to_the_cheapest_replica() -> None:
    """kv_cost ranks by queued prefill, which a cached prompt barely adds to, so a hot
    prefix's holder would keep it: past hot_prefix_gap, the prefix counts as held by every
    usable replica, and the cheapest of them (an idle one) takes the request; null keeps
    it on its holder."""
    moved = _hot_choice([PROMPT], 40, 30, KvCostWorkload())
    assert moved.replica_id.startswith("idle") and moved.note.startswith("hot prefix (100% of")
    assert _hot_choice([PROMPT], 40, 30, KvCostWorkload(hot_prefix_gap=None)).replica_id == (
        "holder"
    )


def test_proxies_behind_a_balancer_spread_conversations_under_a_shared_system_prompt() -> None:
    """Issue #39's many proxies: 48 conversations whose first turns all start with one
    system prompt every replica holds, through 8 kv_cost routers (places 0-7) taking
    turns behind a round-robin balancer, onto 4 equal replicas. Each replica would
    prefill the same tokens at the same rate after no queue a router knows of, so the
    costs are equal; ties went to the lower load, each replica's last report (the same
    for every router until the next, which here comes every 8 requests), and a report
    period's first turns all went to one replica. Each of the four must take its share
    within 1.25x, as kv_aware's routers place them, whatever the loads reported (and
    the hot system prompt's move, past a request beyond the least busy replica, keeps
    the turn's choice where it is as cheap as any)."""
    system = list(range(1000, 1208))  # 13 blocks, a quarter of each first turn
    for seed in range(10):
        rng = random.Random(seed)
        routers = [
            create_policy(KvCostWorkload(), rng=random.Random(seed * 8 + i), place=i)
            for i in range(8)
        ]
        keys = context(KvCostWorkload(), system).block_keys
        sent: Counter[int] = Counter()
        for conversation in range(48):
            if conversation % 8 == 0:  # a load report: the engines' figures at its time
                usage = [rng.uniform(0.0, 0.3) for _ in range(4)]
                running = [rng.randrange(3) for _ in range(4)]
            replicas = [
                ReplicaState(i, f"r{i}", running=running[i], kv_usage=usage[i]) for i in range(4)
            ]
            view = StaticStateView(replicas, residency_known=True)
            for ordinal in range(4):
                view.index.add(ordinal, keys)
            first_turn = system + [100_000 + conversation * 1000 + t for t in range(608)]
            decision = routers[conversation % 8].select(context(KvCostWorkload(), first_turn), view)
            assert decision.reasons[0].hit_blocks == 13  # a hit everywhere, not a new prompt
            assert decision.ordinal is not None
            sent[decision.ordinal] += 1
        assert max(sent.values()) <= 1.25 * 48 / 4, (seed, sent)
