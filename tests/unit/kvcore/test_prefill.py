"""A proxy's own prefill books: the work each replica has still to prefill for it
(``PrefillLedger`` -> ``ReplicaState.queued_prefill_tokens``), read by ``kv_cost``."""

from __future__ import annotations

import pytest

from kvcore.policies import PrefillLedger, ReplicaState, StaticStateView, create_policy
from kvcore.workload import KvCostWorkload
from tests.unit.kvcore.policy_helpers import context


def test_an_idle_replica_starts_at_once_and_works_through_its_queue() -> None:
    ledger = PrefillLedger(prefill_tokens_per_s=1000)
    ledger.sent(0, 2000, at=10.0)
    assert ledger.queued_tokens(0, now=10.0) == 2000
    assert ledger.queued_tokens(0, now=11.5) == pytest.approx(500)  # 1.5 s of prefill done
    ledger.sent(0, 1000, at=11.5)  # behind the first
    assert ledger.queued_tokens(0, now=11.5) == 1500
    assert ledger.queued_tokens(0, now=20.0) == 0  # never negative
    assert ledger.queued_tokens(1, now=20.0) == 0  # a replica never sent to


def test_a_first_token_anchors_what_is_still_pending() -> None:
    """The engine was slower than assumed: the first answer came at 13.0, not 12.0, so
    the second request starts then and has all its tokens ahead of it."""
    ledger = PrefillLedger(prefill_tokens_per_s=1000)
    first = ledger.sent(0, 2000, at=10.0)
    ledger.sent(0, 1000, at=10.5)
    assert ledger.queued_tokens(0, now=12.9) == pytest.approx(100)  # the ledger's guess
    ledger.first_token(0, first, at=13.0)
    assert ledger.queued_tokens(0, now=13.0) == 1000
    assert ledger.queued_tokens(0, now=13.25) == pytest.approx(750)
    assert ledger.pending(0) == 1


def test_a_replica_slower_than_the_rate_owes_a_new_request_all_of_it() -> None:
    """By the rate, the first request was prefilled by 11 s, but no first token came: a
    request sent at 15 s has none of its work done yet, not 4 s of it."""
    ledger = PrefillLedger(prefill_tokens_per_s=1000)
    ledger.sent(0, 1000, at=10.0)
    assert ledger.queued_tokens(0, now=15.0) == 0
    ledger.sent(0, 2000, at=15.0)
    assert ledger.queued_tokens(0, now=15.0) == pytest.approx(2000)
    assert ledger.queued_tokens(0, now=15.5) == pytest.approx(1500)


def test_an_empty_queue_reads_zero_and_a_late_ticket_changes_nothing() -> None:
    ledger = PrefillLedger(prefill_tokens_per_s=1000)
    ticket = ledger.sent(3, 0.1, at=1.0)
    ledger.first_token(3, ticket, at=1.2)
    ledger.first_token(3, ticket, at=1.3)  # a second end of the same request
    ledger.first_token(7, 99, at=1.3)  # unknown replica and ticket
    assert ledger.pending(3) == 0 and ledger.queued_tokens(3, now=1.3) == 0
    later = ledger.sent(3, 400, at=5.0)  # idle again: anchors at its own send
    assert ledger.queued_tokens(3, now=5.1) == pytest.approx(300)
    ledger.forget(3)
    assert ledger.pending(3) == 0
    ledger.first_token(3, later, at=6.0)  # forgotten: ignored


def test_the_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        PrefillLedger(prefill_tokens_per_s=0)


def test_kv_cost_sends_the_next_request_away_from_a_replica_busy_prefilling() -> None:
    """Replica 0 holds the prompt's prefix but is prefilling 20,000 tokens this proxy sent
    it a moment ago: the engine's last report (waiting 0) cannot show that, the books do."""
    workload = KvCostWorkload(locality_weight=0.5, prefill_tokens_per_s=10_000)
    tokens = list(range(100, 228))
    ctx = context(workload, tokens, now=50.1)
    ledger = PrefillLedger(workload.prefill_tokens_per_s)
    ledger.sent(0, 20_000, at=50.0)
    replicas = [
        ReplicaState(o, f"r{o}", queued_prefill_tokens=ledger.queued_tokens(o, 50.1))
        for o in range(2)
    ]
    view = StaticStateView(replicas, residency_known=True)
    view.index.add(0, ctx.block_keys[:7])
    decision = create_policy(workload).select(ctx, view)
    assert decision.replica_id == "r1"
    rows = {r.replica_id: r for r in decision.reasons}
    assert rows["r0"].wait_s == pytest.approx(19_000 / 10_000)  # 1.9 s still queued
    assert rows["r0"].score == pytest.approx(-(19_000 + 16) / 10_000 / 2)
    assert rows["r1"].score == pytest.approx(-128 / 10_000 / 2)


def three_queued() -> tuple[PrefillLedger, list[int]]:
    """Replica 0 at 1,000 tokens/s, sent three requests of 1,000 uncached tokens at 10 s."""
    ledger = PrefillLedger(prefill_tokens_per_s=1000)
    return ledger, [ledger.sent(0, 1000, at=10.0) for _ in range(3)]


def test_a_request_dropped_before_its_turn_takes_only_its_own_tokens_away() -> None:
    """At 10.5 s the replica is half way through the first request (first come, first
    served). Dropping the last leaves the first two as they were."""
    ledger, (_, _, last) = three_queued()
    ledger.dropped(0, last, at=10.5)
    assert ledger.queued_tokens(0, now=10.5) == pytest.approx(1500)
    assert ledger.queued_tokens(0, now=11.0) == pytest.approx(1000)
    assert ledger.pending(0) == 2


def test_work_on_a_dropped_request_is_not_credited_to_those_behind_it() -> None:
    """The first request is cancelled half way through its prefill: the replica starts on
    the second then, with all of it still to do."""
    ledger = PrefillLedger(prefill_tokens_per_s=1000)
    first = ledger.sent(0, 1000, at=10.0)
    ledger.sent(0, 1000, at=10.0)
    ledger.dropped(0, first, at=10.5)
    assert ledger.queued_tokens(0, now=10.5) == pytest.approx(1000)
    assert ledger.queued_tokens(0, now=10.75) == pytest.approx(750)
    ledger.dropped(0, first, at=10.8)  # settled once
    assert ledger.queued_tokens(0, now=10.75) == pytest.approx(750)


def test_a_whole_answer_proves_its_prefill_and_the_earlier_ones_done() -> None:
    """A non-streamed answer for the second request arrives at 10.1 s, sooner than the
    assumed rate allows: both it and the request ahead of it were prefilled, so only the
    third is left, all of it, starting now."""
    ledger, (_, second, _) = three_queued()
    ledger.prefilled(0, second, at=10.1)
    assert ledger.queued_tokens(0, now=10.1) == pytest.approx(1000)
    assert ledger.queued_tokens(0, now=10.6) == pytest.approx(500)
    assert ledger.pending(0) == 2


def test_a_whole_answer_after_the_estimate_keeps_the_rest_of_the_queue_aging() -> None:
    """The second request's answer comes at 12.5 s, after the ledger thought both it and
    the first were done (12.0 s): the third has been prefilling since, at the rate."""
    ledger, (_, second, _) = three_queued()
    ledger.prefilled(0, second, at=12.5)
    assert ledger.queued_tokens(0, now=12.5) == pytest.approx(500)
    ledger.dropped(0, 99, at=12.5)  # unknown ticket
    ledger.prefilled(3, 1, at=12.5)  # unknown replica
    assert ledger.queued_tokens(0, now=12.5) == pytest.approx(500)


def serve(ledger: PrefillLedger, replica: int, tokens: int, rate: float, at: float) -> float:
    """One request of ``tokens`` to an idle ``replica`` that answers 20 ms plus the
    prefill at ``rate`` later; when it answered."""
    ticket = ledger.sent(replica, tokens, at=at)
    done = at + 0.02 + tokens / rate
    ledger.first_token(replica, ticket, at=done)
    return done


LENGTHS = [500, 2_000, 1_000, 4_000, 250, 3_000]  # uncached tokens, in turn


def test_the_learned_prefill_rate_follows_a_replica_whose_speed_changes() -> None:
    """Four replicas prefill at 10,000 tokens/s as configured; then replica 0 (another
    GPU, a longer context) at 4,000. The times the proxy measured to its first tokens
    move its learned rate there within a few dozen requests, its 20 ms around each prefill
    told apart, and routing ranks it at 4,000 once that is 2x slower than configured: a
    replica within 2x keeps the configured figure (timings are noisy, and equal replicas
    rank as equal)."""
    ledger = PrefillLedger(prefill_tokens_per_s=10_000)
    assert ledger.rates.rate(0) == 10_000 and ledger.rates.line(0) is None
    now = 0.0
    for replica in range(4):
        for i in range(30):
            now = serve(ledger, replica, LENGTHS[i % 6], 10_000, now) + 1.0
    fixed, rate = ledger.rates.line(0) or (0.0, 0.0)
    assert (fixed, rate) == (pytest.approx(0.02), pytest.approx(10_000))
    for i in range(30):
        now = serve(ledger, 5, LENGTHS[i % 6], 7_000, now) + 1.0
    assert ledger.rates.learned(5) == pytest.approx(7_000)
    assert ledger.rates.rate(5) == 10_000
    learned, ranked = [], []
    for i in range(300):
        now = serve(ledger, 0, LENGTHS[i % 6], 4_000, now) + 1.0
        learned.append(ledger.rates.learned(0) or 0.0)
        ranked.append(ledger.rates.rate(0))
    assert learned[0] > 9_000  # one slow answer moves it only a little
    assert learned[90] == pytest.approx(4_000, rel=0.05)
    assert learned[-1] == pytest.approx(4_000, rel=0.001)
    assert ranked[0] == 10_000 and ranked[-1] == pytest.approx(4_000, rel=0.01)
    # and the queue it sees drains at the learned rate, its step's 20 ms around the
    # prefill still to run (80 tokens at that rate)
    ledger.sent(0, 8_000, at=now)
    assert ledger.rates.around_s(0) == pytest.approx(0.02, rel=0.1)
    assert ledger.queued_tokens(0, now=now + 1.0) == pytest.approx(4_080, rel=0.01)


def test_a_replica_with_no_history_starts_from_the_fleets_median() -> None:
    """Configured at 20,000 tokens/s, the fleet's replicas prefill at 6,000 and 8,000:
    a replica never timed is ranked at their median, 7,000."""
    ledger = PrefillLedger(prefill_tokens_per_s=20_000)
    now = 0.0
    for replica, speed in ((0, 6_000), (1, 8_000)):
        for i in range(30):
            now = serve(ledger, replica, LENGTHS[i % 6], speed, now) + 1.0
    assert ledger.rates.rate(0) == pytest.approx(6_000, rel=0.01)
    assert ledger.rates.rate(7) == pytest.approx(7_000, rel=0.01)


def test_only_a_request_sent_to_an_idle_replica_is_timed() -> None:
    """A request queued behind another of this router's waited for it too: its time to
    first token says nothing of its own prefill. Nor do prompts all of one length, which
    cannot tell the prefill from the time around it."""
    ledger = PrefillLedger(prefill_tokens_per_s=30_000)
    now = 0.0
    for _ in range(40):
        first, second = ledger.sent(0, 1_000, at=now), ledger.sent(0, 3_000, at=now)
        ledger.first_token(0, first, at=now + 0.12)
        ledger.first_token(0, second, at=now + 2.0)  # 3,000 tokens in 2 s: not timed
        now += 5.0
    assert ledger.rates.line(0) is None  # one length only: no line yet
    for i in range(40):
        now = serve(ledger, 0, LENGTHS[i % 6], 10_000, now) + 1.0
    assert ledger.rates.learned(0) == pytest.approx(10_000, rel=0.01)


def test_a_replica_ten_times_slower_is_told_by_prompts_of_one_length() -> None:
    """Short chat turns or prompts of one length give no line of their own (the time
    around a prefill cannot be told from it), but a replica taking ten times as long as
    the fleet's typical line predicts for the same prompts is ten times slower: ranked
    at a tenth of the rate, where one within 2x of the fleet keeps the configured rate."""
    ledger = PrefillLedger(prefill_tokens_per_s=10_000)
    now = 0.0
    for replica in range(3):
        for i in range(30):
            now = serve(ledger, replica, LENGTHS[i % 6], 10_000, now) + 1.0
    for _ in range(12):  # 300 tokens each: 10x the fleet's 20 ms + 30 ms
        ticket = ledger.sent(3, 300, at=now)
        ledger.first_token(3, ticket, at=now + 0.5)
        ticket = ledger.sent(4, 300, at=now)
        ledger.first_token(4, ticket, at=now + 0.06)  # 1.2x the line: noise
        now += 1.0
    assert ledger.rates.line(3) is None and ledger.rates.slower(3) == pytest.approx(10, rel=0.01)
    assert ledger.rates.rate(3) == pytest.approx(1_000, rel=0.01)
    assert ledger.rates.slower(4) == pytest.approx(1.2, rel=0.01)
    assert ledger.rates.rate(4) == 10_000


def test_without_any_line_slowness_is_read_against_the_fleets_seconds_per_token() -> None:
    """No replica's timings vary enough for a line: one replica's seconds per token ten
    times the fleet's median still rank it ten times slower."""
    ledger = PrefillLedger(prefill_tokens_per_s=10_000)
    now = 0.0
    for _ in range(10):
        for replica, seconds in ((0, 0.1), (1, 0.1), (2, 0.11), (3, 1.0)):
            ticket = ledger.sent(replica, 1_000, at=now)
            ledger.first_token(replica, ticket, at=now + seconds)
        now += 2.0
    assert [ledger.rates.line(r) for r in range(4)] == [None] * 4
    assert ledger.rates.rate(3) == pytest.approx(1_000, rel=0.06)
    assert [ledger.rates.rate(r) for r in range(3)] == [10_000] * 3


def test_a_replica_ten_times_slower_in_every_step_is_told_in_three_timings() -> None:
    """Three replicas answer in 20 ms plus their prefill at 10,000 tokens/s; replica 3
    runs every step ten times as long (0.5 s for 300 tokens, where the fleet takes 50 ms).
    Three timings tell it (eight for a smaller gap, and a replica 1.5x as slow is never
    told from noise): with no line yet, against the fleet's 20 ms around a prefill plus
    the tokens at its rate (per token, the fleet's 20 ms spread over longer prompts read
    it 14x). It is ranked at a tenth of the rate, and each prefill there counts the
    180 ms its steps take beyond the fleet's 20 ms, which its rate alone leaves out; the
    other replicas count none."""
    ledger = PrefillLedger(prefill_tokens_per_s=10_000)
    now = 0.0
    for replica in range(3):
        for i in range(3):
            now = serve(ledger, replica, LENGTHS[i % 6], 10_000, now) + 1.0
    told = []
    for _ in range(3):
        for replica, seconds in ((3, 0.5), (4, 0.075)):  # 10x and 1.5x the fleet's 50 ms
            ticket = ledger.sent(replica, 300, at=now)
            ledger.first_token(replica, ticket, at=now + seconds)
        told.append(ledger.rates.slower(3))
        now += 1.0
    assert told[:2] == [None, None] and told[2] == pytest.approx(10, rel=0.01)
    assert ledger.rates.rate(3) == pytest.approx(1_000, rel=0.01)
    assert ledger.rates.step_s(3) == pytest.approx(0.5 - 300 / 1_000 - 0.02, rel=0.02)
    assert ledger.rates.slower(4) is None and ledger.rates.rate(4) == 10_000
    assert [ledger.rates.step_s(r) for r in (0, 1, 2, 4)] == [0.0] * 4


def test_kv_cost_moves_a_chat_off_a_replica_whose_steps_are_ten_times_longer() -> None:
    """A chat's 2,000-token history is cached on replica 0, whose every engine step takes
    180 ms more than the fleet's (learned: ``extra_step_s``). Its next turn, 48 new
    tokens, costs 48 ms of prefill there at its 1,000 tokens/s, but the step that prefills
    them lasts 180 ms more, and every request queued there waits for it: the turn goes to
    a replica that recomputes the history in 200 ms of its typical steps. A replica with
    typical steps keeps the history."""
    workload = KvCostWorkload(prefill_tokens_per_s=10_000)
    tokens = list(range(1_000, 1_000 + 2_048))
    ctx = context(workload, tokens, now=10.0)

    def chosen(step_s: float) -> str:
        replicas = [
            ReplicaState(0, "r0", prefill_tokens_per_s=1_000, extra_step_s=step_s),
            ReplicaState(1, "r1"),
        ]
        view = StaticStateView(replicas, residency_known=True)
        view.index.add(0, ctx.block_keys[:125])  # all but the last 48 tokens
        decision = create_policy(workload).select(ctx, view)
        rows = {r.replica_id: r for r in decision.reasons}
        assert rows["r0"].prefill_s == pytest.approx(48 / 1_000 + step_s)
        assert rows["r0"].extra_step_s == (step_s or None)
        return decision.replica_id

    assert chosen(0.18) == "r1"
    assert chosen(0.0) == "r0"


def test_a_replica_slow_in_some_timings_only_is_not_ranked_slower() -> None:
    """Behind several proxies a timing may wait for another proxy's long prefill: an
    ordinary replica half of whose timings read ten times the fleet's takes 5.5x as long
    on the whole, but each of a slower replica's timings is slow, and this one's are
    not: it keeps the configured rate (ranked by their sum, it drew its prefixes' hot
    moves and lost bench sim's e2e_shared_prefix 1.5 points of hit rate behind 8)."""
    ledger = PrefillLedger(prefill_tokens_per_s=10_000)
    now = 0.0
    for replica in range(3):
        for i in range(3):
            now = serve(ledger, replica, LENGTHS[i % 6], 10_000, now) + 1.0
    for i in range(16):  # 300 tokens: the fleet's 50 ms, or 0.5 s behind another's prefill
        ticket = ledger.sent(3, 300, at=now)
        ledger.first_token(3, ticket, at=now + (0.5 if i % 2 else 0.05))
        now += 1.0
    assert ledger.rates.slower(3) == pytest.approx(5.5, rel=0.1)
    assert ledger.rates.rate(3) == 10_000 and ledger.rates.step_s(3) == 0.0


def test_a_replica_reads_busy_until_the_step_prefilling_this_proxys_request_ends() -> None:
    """The fleet's timings show 20 ms around each prefill (the decode of the running
    batch in the same step, the engine's overhead). A 128-token hit sent to replica 0
    takes 12.8 ms at 10,000 tokens/s, but its step runs 20 ms more, and a request sent
    there meanwhile waits for that step to end: 15 ms after the send the books still owe
    5 ms of it (50 tokens at the rate), and kv_cost sends the next hit to replica 1,
    though replica 1 runs more. Drained by its tokens alone, replica 0 read idle from
    12.8 ms on and drew the request (in bench sim's ``one_system_prompt`` a fifth of the
    requests went to a replica in the middle of such a step, at 42 ms mean TTFT against
    35 ms on the others)."""
    workload = KvCostWorkload(prefill_tokens_per_s=10_000)
    ledger = PrefillLedger(workload.prefill_tokens_per_s)
    now = 0.0
    for replica in (1, 2, 3):
        for i in range(3):
            now = serve(ledger, replica, LENGTHS[i], 10_000, now) + 1.0
    assert ledger.rates.around_s(0) == pytest.approx(0.02)
    ledger.sent(0, 128, at=now)
    assert ledger.queued_tokens(0, now=now + 0.015) == pytest.approx(128 - 150 + 200)
    assert ledger.queued_tokens(0, now=now + 0.033) == 0  # its step is over
    tokens = list(range(100, 228))
    ctx = context(workload, tokens, now=now + 0.015)
    replicas = [
        ReplicaState(0, "r0", running=2, queued_prefill_tokens=ledger.queued_tokens(0, ctx.now)),
        ReplicaState(1, "r1", running=3, queued_prefill_tokens=ledger.queued_tokens(1, ctx.now)),
    ]
    view = StaticStateView(replicas, residency_known=True)
    for ordinal in (0, 1):
        view.index.add(ordinal, ctx.block_keys)
    decision = create_policy(workload).select(ctx, view)
    assert decision.replica_id == "r1"
    rows = {r.replica_id: r for r in decision.reasons}
    assert rows["r0"].wait_s == pytest.approx(0.0178)
