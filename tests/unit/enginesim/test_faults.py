"""Fault state: updates, injected 500s, and the seeded error rate."""

from __future__ import annotations

import msgspec
import pytest

from enginesim.faults import FaultInjector, FaultUpdate


def test_fail_requests_counts_down_then_stops() -> None:
    injector = FaultInjector()
    injector.state.apply(FaultUpdate(fail_requests=2))
    assert [injector.should_fail() for _ in range(4)] == [True, True, False, False]


def test_error_rate_is_reproducible_and_close_to_the_rate() -> None:
    def outcomes() -> list[bool]:
        injector = FaultInjector(seed=7)
        injector.state.apply(FaultUpdate(error_rate=0.25))
        return [injector.should_fail() for _ in range(2000)]

    first = outcomes()
    assert first == outcomes()
    assert 0.2 < sum(first) / len(first) < 0.3


def test_clear_resets_every_lasting_fault() -> None:
    injector = FaultInjector()
    injector.state.apply(FaultUpdate(pause_events=True, slowdown=3, delay_ms=5, error_rate=1))
    injector.state.apply(injector.clear())
    assert not injector.state.events_paused and injector.state.slowdown == 1.0
    assert not injector.should_fail()


@pytest.mark.parametrize(
    "body", [b'{"slowdown": 0.5}', b'{"error_rate": 2}', b'{"fail_requests": -1}', b'{"x": 1}']
)
def test_out_of_range_updates_are_refused(body: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(body, type=FaultUpdate)
