"""First-byte deadlines and suspect replicas (dataplane.first_byte, CircuitBreakers)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from dataplane.breaker import CircuitBreakers
from dataplane.endpoints import Endpoint
from dataplane.first_byte import FirstByteDeadlines, SuspectProber
from dataplane.upstream import Opened, Retriable


def deadlines() -> FirstByteDeadlines:
    return FirstByteDeadlines(
        floor_s=1.0, factor=10.0, slowest_tokens_per_s=1000.0, cap_s=60.0, clock=lambda: 0.0
    )


def test_a_replica_not_timed_yet_gets_the_floor_plus_its_prompt_at_the_slowest_rate() -> None:
    assert deadlines().deadline_s("r0", 500) == pytest.approx(1.5)


def test_a_slow_replica_gets_factor_times_its_typical_first_byte() -> None:
    d = deadlines()
    for ttfb in (0.4, 0.4, 0.4):
        d.answered("slow", ttfb)
    d.answered("fast", 0.02)
    assert d.deadline_s("slow", 0) == pytest.approx(4.0)
    assert d.deadline_s("fast", 0) == pytest.approx(1.0)  # the floor


def test_the_typical_first_byte_moves_a_fifth_of_the_way_to_each_new_one() -> None:
    d = deadlines()
    d.answered("r0", 0.2)
    d.answered("r0", 0.7)
    assert d.deadline_s("r0", 0) == pytest.approx(10 * 0.3)


def test_a_long_prompt_is_never_cut_for_its_length_and_upstream_timeout_caps_it() -> None:
    d = deadlines()
    assert d.deadline_s("r0", 30_000) == pytest.approx(31.0)
    assert d.deadline_s("r0", 1_000_000) == 60.0


def test_a_suspect_is_out_until_its_probe_answers_whatever_fails_meanwhile() -> None:
    breakers = CircuitBreakers(failures=5, open_s=5.0)
    breakers.suspect("r1", 1, "http://h:1", now=0.0)
    assert breakers.excluded(0.0) == {1}
    assert breakers.suspects() == {"r1": (1, "http://h:1")}
    breakers.on_failure("r1", 1, now=1.0)
    assert breakers.excluded(1e9) == {1}  # no end in time
    breakers.on_probe_answered("r1", now=2.0)
    assert breakers.excluded(2.0) == frozenset() and breakers.suspects() == {}


def test_a_request_the_suspect_still_had_answering_clears_it_too() -> None:
    breakers = CircuitBreakers(failures=5, open_s=5.0)
    breakers.suspect("r1", 1, "http://h:1", now=0.0)
    breakers.on_success("r1", now=1.0)
    assert breakers.excluded(1.0) == frozenset()


async def wait_for_first_bytes(
    deadlines: FirstByteDeadlines, answer: asyncio.Future[str], deadline_s: float
) -> str:
    """What ``Dispatcher.first_bytes`` does around a replica's answer."""
    task = deadlines.begin(deadline_s)
    try:
        got = await answer
    except asyncio.CancelledError:
        if deadlines.end(task):
            await asyncio.sleep(0)  # no cancellation left pending: it may go on
            return f"moved elsewhere ({task.cancelling()} cancellations pending)"
        raise
    deadlines.end(task)
    return got


async def test_a_request_past_its_deadline_is_let_go_and_goes_on() -> None:
    d = FirstByteDeadlines(0.2, 10.0, 1000.0, 60.0, clock=time.monotonic)
    keeper = asyncio.create_task(d.run())
    try:
        loop = asyncio.get_running_loop()
        hung, quick = loop.create_future(), loop.create_future()
        started = time.monotonic()
        waiting = asyncio.gather(
            wait_for_first_bytes(d, hung, 0.2), wait_for_first_bytes(d, quick, 5.0)
        )
        loop.call_later(0.05, quick.set_result, "answered")
        assert await waiting == ["moved elsewhere (0 cancellations pending)", "answered"]
        assert 0.2 <= time.monotonic() - started < 0.2 + 2 * d.tick_s + 0.2
    finally:
        keeper.cancel()


async def test_a_client_going_away_is_still_a_cancellation() -> None:
    d = FirstByteDeadlines(1.0, 10.0, 1000.0, 60.0, clock=time.monotonic)
    hung = asyncio.get_running_loop().create_future()
    request = asyncio.create_task(wait_for_first_bytes(d, hung, 5.0))
    await asyncio.sleep(0)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request


class Fleet:
    """The replicas' endpoints by ordinal, as FleetState gives them."""

    def __init__(self, **replicas: int) -> None:
        self.by_ordinal = {
            o: Endpoint(o, r, "p", f"http://h/{r}", "m", (), "") for r, o in replicas.items()
        }

    def endpoint(self, ordinal: int) -> Endpoint | None:
        return self.by_ordinal.get(ordinal)


class Unreachable:
    """An upstream every probe fails to reach (duck-typed: ``Upstream`` is compiled by
    mypyc in a native build, and an interpreted class cannot inherit from it)."""

    async def open(self, method: str, url: str, body: bytes, headers: Any) -> Opened:
        raise Retriable(f"cannot reach {url}", "connect")


async def test_a_suspect_gone_from_the_fleet_or_renumbered_is_forgotten_not_probed() -> None:
    breakers = CircuitBreakers(failures=5, open_s=5.0)
    for replica, ordinal in (("r0", 0), ("r1", 1), ("r2", 2)):
        breakers.suspect(replica, ordinal, f"http://h/{replica}", now=0.0)
    fleet = Fleet(r0=0, r9=1)  # r1's ordinal now names r9; r2 left
    prober = SuspectProber(breakers, fleet, Unreachable(), 0.5, 1.0, clock=lambda: 1.0)
    await prober.probe_all()
    assert list(breakers.suspects()) == ["r0"]  # still unreachable: still out
    assert breakers.excluded(1.0) == {0}


async def wait_for_whole_answer(
    deadlines: FirstByteDeadlines, endpoint: Endpoint, answer: asyncio.Future[str]
) -> str:
    """What ``Dispatcher.first_bytes`` does around a replica's whole answer."""
    task = deadlines.begin_whole(endpoint, 0.2)
    try:
        got = await answer
    except asyncio.CancelledError:
        if deadlines.end(task):
            return "moved elsewhere"
        raise
    deadlines.end(task)
    return got


class Replies:
    """Health probes answered (or not) per replica, counted."""

    def __init__(self, alive: set[str]) -> None:
        self.alive = alive
        self.asked: list[str] = []

    async def ask(self, endpoint: Endpoint) -> bool:
        self.asked.append(endpoint.replica_id)
        return endpoint.replica_id in self.alive


async def test_a_whole_answer_waits_while_its_replica_answers_probes_and_no_longer() -> None:
    """Deadline 0.2 s: a live replica's answer after 0.7 s (over three deadlines) is
    waited for; a silent replica's is let go at its deadline, as a stream would be."""
    replies = Replies(alive={"live"})
    d = FirstByteDeadlines(0.2, 10.0, 1000.0, 60.0, clock=time.monotonic, ask=replies.ask)
    keeper = asyncio.create_task(d.run())
    try:
        loop = asyncio.get_running_loop()
        slow, never = loop.create_future(), loop.create_future()
        live, hung = Fleet(live=0, hung=1).by_ordinal.values()
        started = time.monotonic()
        silent = asyncio.create_task(wait_for_whole_answer(d, hung, never))
        assert await silent == "moved elsewhere"
        assert 0.2 <= time.monotonic() - started < 0.2 + 2 * d.tick_s + 0.2
        loop.call_later(0.7, slow.set_result, "answered")
        assert await wait_for_whole_answer(d, live, slow) == "answered"
        assert 3 <= replies.asked.count("live") <= 8  # one probe per half deadline of silence
    finally:
        keeper.cancel()


async def test_an_answer_from_the_replica_to_another_request_is_a_sign_of_life() -> None:
    replies = Replies(alive=set())  # probes never answer
    d = FirstByteDeadlines(0.2, 10.0, 1000.0, 60.0, clock=time.monotonic, ask=replies.ask)
    keeper = asyncio.create_task(d.run())
    try:
        loop = asyncio.get_running_loop()
        slow = loop.create_future()
        (busy,) = Fleet(busy=0).by_ordinal.values()
        for at in (0.1, 0.25, 0.4, 0.55):  # other requests' first bytes
            loop.call_later(at, lambda: d.heard_from("busy", time.monotonic()))
        loop.call_later(0.6, slow.set_result, "answered")
        assert await wait_for_whole_answer(d, busy, slow) == "answered"
    finally:
        keeper.cancel()
