"""A failing replica is taken out, probed back with one request, and retries stay bounded."""

from __future__ import annotations

from dataplane.breaker import CircuitBreakers, RetryBudget


def test_a_replica_failing_in_a_row_is_out_then_probed_by_one_request() -> None:
    b = CircuitBreakers(failures=3, open_s=5.0)
    for t in (0.0, 0.1):
        b.on_failure("r1", 1, t)
    assert b.excluded(0.2) == frozenset()  # two failures: still routable
    b.on_failure("r1", 1, 0.3)
    assert b.excluded(0.4) == {1} and b.open_ids(0.4) == ["r1"]
    assert b.excluded(5.4) == frozenset()  # half-open
    b.on_sent("r1", 1, 5.4)  # the probe
    assert b.excluded(5.5) == {1}  # nobody else while it is out
    b.on_failure("r1", 1, 5.6)
    assert b.excluded(10.5) == {1} and b.excluded(10.7) == frozenset()
    b.on_sent("r1", 1, 10.7)
    b.on_success("r1", 10.8)
    assert b.excluded(10.9) == frozenset() and b.open_ids(10.9) == []


def test_an_abandoned_probe_lets_another_request_probe() -> None:
    b = CircuitBreakers(failures=1, open_s=1.0)
    b.on_failure("r0", 0, 0.0)
    b.on_sent("r0", 0, 2.0)
    assert b.excluded(2.0) == {0}
    b.on_abandoned("r0", 2.1)
    assert b.excluded(2.1) == frozenset()


def test_the_retry_budget_is_a_share_of_requests_plus_a_floor() -> None:
    budget = RetryBudget(ratio=0.25, min_per_s=0.0, now=0.0)
    spent = sum(budget.try_spend(0.0) for _ in range(100))
    assert spent == 26  # the bank: 1 + 100 * 0.25
    for _ in range(50):
        budget.on_request()
    assert sum(budget.try_spend(0.0) for _ in range(100)) == 12
    floor = RetryBudget(ratio=0.0, min_per_s=10.0, now=0.0)
    assert sum(floor.try_spend(0.0) for _ in range(100)) == 10
    assert sum(floor.try_spend(1.0) for _ in range(100)) == 10
