"""A replica's load counts this proxy's requests once: the engine's report, plus the
requests sent after it (``InflightLedger`` -> ``ReplicaState.unreported``)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.policies import InflightLedger, ReplicaState, StaticStateView, create_policy
from kvcore.policies.inflight import _SLACK, discount_ended
from kvcore.workload import KvAwareWorkload
from tests.unit.kvcore.policy_helpers import context


def _send(ledger: InflightLedger, replica: int, times: list[float]) -> list[int]:
    return [ledger.sent(replica, at) for at in times]


def test_requests_the_engine_already_reports_are_not_counted_again() -> None:
    """128 requests from one proxy on a 256-slot replica: the engine reports them running."""
    ledger = InflightLedger()
    _send(ledger, 0, [100.0 + i / 1000 for i in range(128)])
    report_ts = 101.0  # taken after all 128 arrived; the engine reports running=128
    replica = ReplicaState(0, "r0", running=128, unreported=ledger.unreported(0, report_ts))
    assert replica.requests == 128
    assert replica.load == 0.5  # not 1.0
    _send(ledger, 0, [101.5] * 64)  # sent after the report: not in the engine's figures
    replica = ReplicaState(0, "r0", running=128, unreported=ledger.unreported(0, report_ts))
    assert replica.load == 0.75
    assert ledger.inflight(0) == 192


def test_a_half_full_holder_of_the_prefix_is_not_taken_for_saturated() -> None:
    ledger = InflightLedger()
    _send(ledger, 0, [10.0] * 128)
    replicas = [
        ReplicaState(0, "warm", running=128, unreported=ledger.unreported(0, 11.0)),
        ReplicaState(1, "cold", running=100),
    ]
    workload = KvAwareWorkload(load_threshold=0.9)
    view = StaticStateView(replicas)
    tokens = list(range(256))
    view.index.add(0, context(workload, tokens).block_keys)
    decision = create_policy(workload, rng=random.Random(0)).select(context(workload, tokens), view)
    assert decision.replica_id == "warm"
    assert decision.reasons[0].excluded is None and decision.reasons[0].load == 0.5


def test_without_a_report_every_request_in_flight_counts() -> None:
    ledger = InflightLedger()
    tickets = _send(ledger, 3, [1.0, 2.0, 3.0])
    assert ledger.unreported(3) == 3
    ledger.done(3, tickets[1])
    ledger.done(3, tickets[1])  # twice: ignored
    ledger.done(3, 999)  # unknown: ignored
    assert ledger.unreported(3) == 2 == ledger.inflight(3)
    assert ledger.unreported(7) == 0 == ledger.inflight(7)


def test_requests_finishing_out_of_order_around_a_report() -> None:
    ledger = InflightLedger()
    first, second, third, fourth = _send(ledger, 0, [1.0, 2.0, 3.0, 4.0])
    assert ledger.unreported(0, 2.5) == 2
    ledger.done(0, third)  # sent after the report
    assert ledger.unreported(0, 2.5) == 1
    ledger.done(0, first)  # sent before it: already not counted
    assert ledger.unreported(0, 2.5) == 1
    assert ledger.unreported(0, 4.0) == 0  # a newer report includes the fourth
    assert ledger.inflight(0) == 2
    ledger.done(0, second)
    ledger.done(0, fourth)
    assert ledger.inflight(0) == 0


def test_a_report_time_moving_back_recounts() -> None:
    """A restarted sidecar's clock may be behind the last report's."""
    ledger = InflightLedger()
    _send(ledger, 0, [1.0, 2.0, 3.0])
    assert ledger.unreported(0, 5.0) == 0
    assert ledger.unreported(0, 1.5) == 2
    assert ledger.unreported(0, -math.inf) == 3


def test_forget_drops_a_replica_whose_ordinal_may_be_reused() -> None:
    ledger = InflightLedger()
    ticket = ledger.sent(2, 1.0)
    ledger.forget(2)
    ledger.done(2, ticket)
    assert ledger.inflight(2) == 0 == ledger.unreported(2)


def test_memory_stays_bounded_behind_a_long_request() -> None:
    """One stream open for the whole run while 20,000 short requests come and go, with
    and without load reports."""
    for with_reports in (False, True):
        ledger = InflightLedger()
        ledger.sent(0, 0.0)
        for i in range(20_000):
            ledger.done(0, ledger.sent(0, 1.0 + i))
            if with_reports and i % 50 == 0:
                ledger.unreported(0, 0.5 + i)
        state = ledger._replicas[0]
        assert len(state.after) <= 2 + _SLACK
        assert ledger.inflight(0) == 1


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(0, 2), st.floats(0, 100)),
        st.tuples(st.just("done"), st.integers(0, 2), st.integers(0, 60)),
        st.tuples(st.just("report"), st.integers(0, 2), st.floats(0, 100)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_the_ledger_counts_what_a_brute_force_count_does(ops: list[tuple[str, int, float]]) -> None:
    """Against a plain list of (replica, ticket, send time): sends with clock steps
    back (times are kept non-decreasing per replica), ends in any order, reports forward
    and back."""
    ledger = InflightLedger()
    live: dict[int, tuple[int, float]] = {}
    tickets: list[tuple[int, int]] = []
    latest: dict[int, float] = {}
    for op, replica, value in ops:
        if op == "send":
            at = latest[replica] = max(value, latest.get(replica, -math.inf))
            ticket = ledger.sent(replica, value)
            live[ticket] = (replica, at)
            tickets.append((replica, ticket))
        elif op == "done" and tickets:
            owner, ticket = tickets[int(value) % len(tickets)]
            ledger.done(owner, ticket)
            live.pop(ticket, None)
        elif op == "report":
            expected = sum(1 for r, at in live.values() if r == replica and at > value)
            assert ledger.unreported(replica, value) == expected
        assert ledger.inflight(replica) == sum(1 for r, _ in live.values() if r == replica)


def test_total_counts_every_replicas_requests_in_flight() -> None:
    ledger = InflightLedger()
    assert ledger.total() == 0
    a = ledger.sent(0, 1.0)
    ledger.sent(3, 2.0)
    ledger.sent(3, 3.0)
    assert ledger.total() == 3
    ledger.done(0, a)
    ledger.forget(3)
    assert ledger.total() == 0


def test_requests_the_report_counted_that_ended_since_are_known() -> None:
    """The report at ts=10 counts the requests sent by then that had not ended by then;
    of those, the ones ended after it are ``ended`` until a report taken after their end
    arrives (it no longer counts them)."""
    ledger = InflightLedger()
    early, a, b = (ledger.sent(0, at) for at in (8.0, 9.0, 9.5))
    late = ledger.sent(0, 10.5)  # sent after the report: unreported, never ``ended``
    ledger.done(0, early, 9.9)  # ended before the report was taken: not in it
    assert (ledger.unreported(0, 10.0), ledger.ended(0, 10.0)) == (1, 0)
    ledger.done(0, a, 10.2)
    ledger.done(0, late, 10.7)
    ledger.done(0, a, 10.8)  # twice: ignored
    assert (ledger.unreported(0, 10.0), ledger.ended(0, 10.0)) == (0, 1)
    ledger.done(0, b)  # an end without its time: left out
    assert ledger.ended(0, 10.0) == 1
    assert ledger.ended(0, 10.6) == 1  # a report at 10.6 no longer counts ``a``; ``late``
    assert ledger.ended(0, 10.8) == 0  # ... ended after it, a report at 10.8 neither
    assert ledger.ended(0, 10.0) == 0  # their ends were dropped: a report walks forward
    assert ledger.ended(5) == 0 and ledger.inflight(0) == 0


def test_a_replica_keeps_a_bounded_number_of_ends_without_reports() -> None:
    ledger = InflightLedger()
    tickets = [ledger.sent(0, 1.0) for _ in range(5000)]
    assert ledger.ended(0, 2.0) == 0
    for ticket in tickets:
        ledger.done(0, ticket, 3.0)
    assert ledger.ended(0, 2.0) == 4096  # the oldest ends dropped beyond the bound


def test_ended_requests_leave_the_reports_figures_as_the_engine_refills_them() -> None:
    """An ended request's room goes to a waiting one if any (the waiting figure drops,
    the running one and the KV usage stay); else it leaves the running figure and its
    share of the KV usage."""
    assert discount_ended(4, 0, 0.4, 1) == (3, 0, pytest.approx(0.3))
    assert discount_ended(4, 3, 0.9, 2) == (4, 1, 0.9)  # two waiting took their room
    assert discount_ended(4, 1, 0.8, 2) == (3, 0, pytest.approx(0.6))
    assert discount_ended(2, 0, 0.5, 5) == (0, 0, 0.0)  # never below nothing
    assert discount_ended(0, 0, 0.2, 3) == (0, 0, 0.2)  # a report of nothing: as it is
    assert discount_ended(3, 1, 0.6, 0) == (3, 1, 0.6)
