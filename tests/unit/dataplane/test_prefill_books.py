"""The proxy's own prefill books (``dataplane.prefill_books`` through ``FleetState``): what
kv_cost reads as each replica's queued prefill, right at decision time."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.fleet.state import FleetState
from dataplane.main import SettingsRefused, load_settings
from dataplane.metrics import ProxyMetrics
from dataplane.service import ProxyService
from kvcore.keys import block_keys
from kvcore.pb import events_pb2, routing_pb2
from kvcore.policies import Decision, RouteContext, create_policy
from kvcore.workload import KvCostWorkload
from tests.unit.dataplane.state_messages import (
    MODEL,
    config,
    delta,
    replica,
    residency_change,
    snapshot,
)

RATE = 10_000.0  # the kv_cost workload's prefill tokens per second
KV_COST = {"name": "default", "strategy": "kv_cost", "prefill_tokens_per_s": RATE}
PROMPT = list(range(1000, 1000 + 2048))  # 128 blocks
KEYS = block_keys(PROMPT, model=MODEL)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(
    clock: Clock, workloads: list[dict[str, Any]] | None = None, replicas: int = 2
) -> FleetState:
    state = FleetState(clock=clock, prefill_step_s=0.005)
    routing = config(workloads or [KV_COST])
    state.apply(snapshot(1, 1, [replica(o) for o in range(replicas)], routing=routing)[0])
    return state


def queued(state: FleetState) -> list[float | None]:
    return [r.queued_prefill_tokens for r in state.views.view(MODEL).replicas()]


def route(state: FleetState, keys: list[int], now: float) -> Decision:
    workload = state.catalogue.routing_config().workload("default")
    assert isinstance(workload, KvCostWorkload)
    ctx = RouteContext(workload=workload, model=MODEL, block_keys=keys, now=now)
    return create_policy(workload, rng=random.Random(0)).select(ctx, state.views.view(MODEL))


def test_a_replica_prefilling_a_big_prompt_ranks_behind_an_idle_one_under_kv_cost() -> None:
    """Replica 0 holds the prompt's first 100 blocks, but this proxy just sent it 20,000
    uncached tokens: its last load report (nothing waiting) cannot show that, the books
    do, and kv_cost recomputes the prompt on idle replica 1 (0.2 s) rather than wait
    behind them (2.0 s). The engine's report alone would have said otherwise."""
    clock = Clock()
    state = fleet(clock)
    state.apply(delta(1, 2, residency=[residency_change(0, KEYS[:100])]))
    assert route(state, KEYS, clock.now).replica_id == "r0"  # idle: the cache wins
    state.inflight.on_sent(0, 1e9, uncached_tokens=20_000)
    clock.now += 0.001
    decision = route(state, KEYS, clock.now)
    assert decision.replica_id == "r1"
    scores = {row.replica_id: row.score for row in decision.reasons}
    # alpha 0.8: a fifth of the wait and four fifths of the prefill, in seconds
    assert scores["r0"] == pytest.approx(-(0.2 * 19_990 + 0.8 * 448) / RATE)
    assert scores["r1"] == pytest.approx(-0.8 * 2048 / RATE)


def test_the_queue_drains_with_time_though_nothing_else_changes() -> None:
    clock = Clock()
    state = fleet(clock)
    state.inflight.on_sent(0, 1e9, uncached_tokens=5_000)
    assert queued(state) == [5_000, 0]
    clock.now += 0.01
    assert queued(state) == [pytest.approx(4_900), 0]
    clock.now += 0.004  # within a step: never low, at most a step of prefill high
    assert queued(state) == [pytest.approx(4_900), 0]
    clock.now += 0.2
    assert queued(state) == [pytest.approx(2_860), 0]
    clock.now += 1.0
    assert queued(state) == [0, 0]
    assert not state._books.draining  # drained: no more re-aging for it


def test_a_streamed_first_byte_settles_the_ticket_and_anchors_the_rest() -> None:
    """Two requests queued on replica 0; the first answers its first event 0.5 s later
    than the assumed rate says: the second has all its tokens ahead of it from then."""
    clock = Clock()
    state = fleet(clock)
    first = state.inflight.on_sent(0, 1e9, uncached_tokens=2_000)
    state.inflight.on_sent(0, 1e9, uncached_tokens=1_000)
    clock.now += 0.7
    assert queued(state) == [0, 0]  # by the assumed rate, both are done
    state.inflight.on_first_byte(first, 200, streaming=True)
    assert queued(state) == [1_000, 0]
    state.inflight.on_done(first)  # the stream ends later: nothing more to settle
    assert queued(state) == [1_000, 0]


def test_a_whole_answer_settles_as_prefilled_and_an_error_status_as_never_prefilled() -> None:
    clock = Clock()
    state = fleet(clock)
    whole = state.inflight.on_sent(0, 1e9, uncached_tokens=2_000)
    behind = state.inflight.on_sent(0, 1e9, uncached_tokens=3_000)
    refused = state.inflight.on_sent(1, 1e9, uncached_tokens=4_000)
    clock.now += 0.1
    state.inflight.on_first_byte(whole, 200, streaming=False)  # its prefill and nothing after it
    state.inflight.on_first_byte(refused, 400, streaming=False)  # the engine refused it: none
    assert queued(state) == [3_000, 0]
    state.inflight.on_done(behind)  # cancelled before its first byte
    assert queued(state) == [0, 0]


def test_a_batchs_later_prompts_outlast_its_streams_first_event_not_a_whole_answer() -> None:
    """A batch's first event is its first prompt's first token: the other prompts' 4,000
    tokens stay booked until the request ends. A whole answer settles them all."""
    clock = Clock()
    state = fleet(clock)
    streamed = state.inflight.on_sent(0, 1e9, uncached_tokens=500, later_uncached=4_000)
    whole = state.inflight.on_sent(1, 1e9, uncached_tokens=500, later_uncached=4_000)
    assert queued(state) == [4_500, 4_500]
    clock.now += 0.01  # 100 tokens' prefill
    state.inflight.on_first_byte(streamed, 200, streaming=True)
    state.inflight.on_first_byte(whole, 200, streaming=False)
    assert queued(state) == [4_000, 0]
    state.inflight.on_done(streamed)
    state.inflight.on_done(whole)
    assert queued(state) == [0, 0]
    assert all(state._books._ledger.pending(key) == 0 for key in (0, 1))


def test_a_refused_batch_leaves_nothing_booked() -> None:
    clock = Clock()
    state = fleet(clock)
    refused = state.inflight.on_sent(0, 1e9, uncached_tokens=500, later_uncached=4_000)
    state.inflight.on_first_byte(refused, 400, streaming=True)
    assert queued(state) == [0, 0]


def test_no_tokens_leak_when_attempts_fail_or_are_retried_elsewhere() -> None:
    """A connect failure on replica 0 retried on replica 1, whose stream is cancelled
    before its first byte: after both ends, both queues are empty."""
    clock = Clock()
    state = fleet(clock)
    failed = state.inflight.on_sent(0, 1e9, uncached_tokens=6_000)
    state.inflight.on_done(failed)  # Dispatcher._open on a Retriable failure
    retried = state.inflight.on_sent(1, 1e9, uncached_tokens=6_000)
    assert queued(state) == [0, 6_000]
    state.inflight.on_done(retried)  # the client went away
    assert queued(state) == [0, 0]
    assert state.inflight.total() == 0
    assert all(state._books._ledger.pending(key) == 0 for key in (0, 1))


def test_without_a_kv_cost_workload_no_books_are_kept() -> None:
    clock = Clock()
    state = fleet(clock, [{"name": "default", "strategy": "kv_aware"}])
    ticket = state.inflight.on_sent(0, 1e9, uncached_tokens=5_000)
    assert ticket is not None and ticket.prefill == 0
    assert queued(state) == [None, None]
    state.inflight.on_first_byte(ticket, 200, streaming=True)
    assert not state._books.draining


def test_books_follow_the_config_and_tickets_booked_before_still_settle() -> None:
    """kv_cost is added by a config delta, then removed while a request is in flight; the
    request's end still settles its ticket, so a later kv_cost config starts clean."""
    clock = Clock()
    state = fleet(clock, [{"name": "default", "strategy": "least_load"}])
    assert queued(state) == [None, None]
    state.apply(delta(1, 2, config=config([KV_COST], revision=2)))
    ticket = state.inflight.on_sent(1, 1e9, uncached_tokens=3_000)
    assert queued(state) == [0, 3_000]
    state.apply(delta(1, 3, config=config([{"name": "default", "strategy": "kv_aware"}])))
    assert queued(state) == [None, None]
    state.inflight.on_done(ticket)
    state.apply(delta(1, 4, config=config([KV_COST], revision=4)))
    assert queued(state) == [0, 0]


def test_the_lowest_prefill_rate_of_the_kv_cost_workloads_ages_the_books() -> None:
    clock = Clock()
    slow = {"name": "slow", "strategy": "kv_cost", "prefill_tokens_per_s": 1_000}
    state = fleet(clock, [KV_COST, slow])
    state.inflight.on_sent(0, 1e9, uncached_tokens=2_000)
    clock.now += 1.0
    assert queued(state) == [pytest.approx(1_000), 0]


def test_a_replica_that_leaves_takes_its_books_along() -> None:
    """Replica 1 leaves with a request in flight and a new replica takes its ordinal: the
    newcomer starts with an empty queue, and the old request's end changes nothing."""
    clock = Clock()
    state = fleet(clock)
    ticket = state.inflight.on_sent(1, 1e9, uncached_tokens=3_000)
    state.apply(delta(1, 2, replicas_removed=[1]))
    state.apply(delta(1, 3, replicas_upserted=[replica(1, replica_id="newcomer")]))
    assert queued(state) == [0, 0]
    state.inflight.on_done(ticket)
    assert queued(state) == [0, 0]


def test_the_step_is_a_setting_in_milliseconds_and_must_be_positive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVROUTE_PREFILL_STEP_MS", "20")
    service = ProxyService(load_settings(["--controlplane", "127.0.0.1:9"]))
    assert service.fleet._books.step_s == pytest.approx(0.02)
    with pytest.raises(SettingsRefused, match="--prefill-step-ms"):
        load_settings(["--controlplane", "127.0.0.1:9", "--prefill-step-ms", "0"])


EVENT = st.tuples(
    st.sampled_from(["send", "first_byte", "whole", "refused", "end", "wait"]),
    st.integers(0, 3),  # replica, or which live request
    st.integers(1, 30_000),  # uncached tokens of a send
    st.floats(0.0, 0.5),  # seconds that pass before the event
)


@settings(max_examples=150, deadline=None)
@given(st.lists(EVENT, max_size=40))
def test_what_kv_cost_reads_is_never_low_at_most_a_step_high_and_nothing_leaks(
    events: list[tuple[str, int, int, float]],
) -> None:
    """Any interleaving of sends, first bytes, whole answers, refusals, ends and time:
    every figure a decision reads is the ledger's own figure at that moment, or at most
    one step (5 ms) of prefill above it; when every request has ended, no ticket is open
    and every queue reads zero."""
    clock = Clock()
    state = fleet(clock, replicas=4)
    ledger = state._books._ledger
    assert ledger is not None
    live: list[Any] = []
    for kind, which, tokens, wait in events:
        clock.now += wait
        if kind == "send":
            live.append(state.inflight.on_sent(which, 1e9, uncached_tokens=tokens))
        elif kind != "wait" and live:
            ticket = live[which % len(live)]
            if kind == "end":
                state.inflight.on_done(ticket)
                live.remove(ticket)
            else:
                status = 400 if kind == "refused" else 200
                state.inflight.on_first_byte(ticket, status, streaming=kind == "first_byte")
        for row in state.views.view(MODEL).replicas():
            exact = ledger.queued_tokens(row.ordinal, clock.now)
            assert row.queued_prefill_tokens is not None
            assert exact - 1e-6 <= row.queued_prefill_tokens <= exact + RATE * 0.005 + 1e-6
    for ticket in live:
        state.inflight.on_done(ticket)
    assert all(ledger.pending(ordinal) == 0 for ordinal in range(4))
    assert queued(state) == [0, 0, 0, 0]


def test_routing_between_the_steps_of_a_replica_leaving_reads_the_fleet_as_it_was() -> None:
    """A delta removing replica 1 (still prefilling for this proxy) is applied in steps,
    and a request is routed between two of them: it sees both replicas as they were
    before the delta (the leaving one's figures no longer age), and no error."""
    clock = Clock()
    state = fleet(clock)
    state.apply(delta(1, 2, residency=[residency_change(1, KEYS * 40)]))
    state.inflight.on_sent(1, 1e9, uncached_tokens=5_000)
    assert queued(state) == [0, 5_000]
    steps = state.apply_steps(delta(1, 3, replicas_removed=[1]))
    next(steps)  # the removal has begun: the replica's residency is being cleared
    clock.now += 0.01
    assert queued(state) == [0, 5_000]
    for _ in steps:
        pass
    assert queued(state) == [0]


def time_r1_at_2000(state: FleetState, clock: Clock) -> None:
    """30 requests to r1, each timed from idle: it answers 2,000 tokens/s plus 20 ms."""
    for i in range(30):
        tokens = (500, 2_000, 1_000, 4_000, 250, 3_000)[i % 6]
        ticket = state.inflight.on_sent(1, 1e9, uncached_tokens=tokens)
        clock.now += 0.02 + tokens / 2_000
        state.inflight.on_first_byte(ticket, 200, streaming=True)
        state.inflight.on_done(ticket)
        clock.now += 1.0


def test_the_rate_each_replica_is_ranked_at_is_a_metric() -> None:
    """``kvroute_proxy_prefill_tokens_per_second{replica}``: the configured rate until a
    replica's timings show it 2x slower, then what they show (and a replica with no
    timings of its own, the fleet's median); nothing without kv_cost."""
    clock = Clock()
    state = fleet(clock)
    assert state.inflight.prefill_rates() == {"r0": RATE, "r1": RATE}
    time_r1_at_2000(state, clock)
    rates = state.inflight.prefill_rates()
    assert rates["r1"] == pytest.approx(2_000, rel=0.01) and rates["r0"] == rates["r1"]
    assert state.views.view(MODEL).replicas()[1].prefill_tokens_per_s == rates["r1"]
    metrics = ProxyMetrics()
    metrics.watch_prefill_rates(state.inflight.prefill_rates)
    assert 'kvroute_proxy_prefill_tokens_per_second{replica="r1"} 2' in metrics.render().decode()
    assert (
        fleet(clock, [{"name": "default", "strategy": "kv_aware"}]).inflight.prefill_rates() == {}
    )


def test_what_the_proxy_learned_goes_in_its_reports() -> None:
    """``learned_rates`` (each report's, for ``/v1/replicas``): a replica's fitted line and
    the rate routing ranks it at once its timings tell them; none for a replica with no
    timings (r0), none without kv_cost."""
    clock = Clock()
    state = fleet(clock)
    assert state.inflight.learned_rates() == []
    time_r1_at_2000(state, clock)
    [r1] = state.inflight.learned_rates()
    assert r1.replica_id == "r1"
    assert r1.prefill_tokens_per_s == pytest.approx(2_000, rel=0.01)
    assert r1.line_tokens_per_s == pytest.approx(2_000, rel=0.01)
    assert r1.line_fixed_s == pytest.approx(0.02, abs=0.001)
    assert r1.slowness == pytest.approx(1.0, rel=0.01)  # the only line: the typical one
    kv_aware = fleet(clock, [{"name": "default", "strategy": "kv_aware"}])
    assert kv_aware.inflight.learned_rates() == []


def engine_reports(state: FleetState, ordinal: int, speed: float, count: int) -> None:
    """``count`` load reports of replica ``ordinal``'s engine, 0.5 s apart, busy with
    1,000-token prefills at ``speed`` tokens/s (20 ms around each), as its sidecar sends
    them: running totals (versions from 2)."""
    per_request = 0.02 + 1_000 / speed
    served = 0.5 / per_request
    for k in range(1, count + 1):
        load = events_pb2.LoadReport(
            ts=1_000.0 + 0.5 * k,
            prefill_requests=round(served * k),
            prefill_seconds=round(served * k) * per_request,
            prefill_computed_tokens=round(served * k) * 1_000,
        )
        state.apply(delta(1, k + 1, loads=[routing_pb2.LoadUpdate(ordinal=ordinal, load=load)]))


def test_an_engines_own_timing_ranks_a_replica_its_proxys_timings_read_slow() -> None:
    """r1's first tokens came at 2,000 tokens/s (this proxy's clock, which behind several
    proxies also waits for theirs): alone they rank it there. Its engine's load reports
    show it prefilling at 8,000 tokens/s at least: ranked at the configured 10,000, the
    bound in the proxy's report for ``/v1/replicas``. With ``engine_prefill_rates`` off
    the reports are not read."""
    clock = Clock()
    state = fleet(clock)
    time_r1_at_2000(state, clock)
    assert state.inflight.prefill_rates()["r1"] == pytest.approx(2_000, rel=0.01)
    engine_reports(state, 1, 10_000, 20)
    assert state.inflight.prefill_rates()["r1"] == RATE
    assert state.views.view(MODEL).replicas()[1].prefill_tokens_per_s == RATE
    [r1] = state.inflight.learned_rates()
    assert r1.engine_tokens_per_s == pytest.approx(1_000 / 0.12, rel=0.02)
    off = fleet(clock, [{**KV_COST, "engine_prefill_rates": False}])
    time_r1_at_2000(off, clock)
    engine_reports(off, 1, 10_000, 20)
    assert off.inflight.prefill_rates()["r1"] == pytest.approx(2_000, rel=0.01)
    assert off.inflight.learned_rates()[0].engine_tokens_per_s == 0
