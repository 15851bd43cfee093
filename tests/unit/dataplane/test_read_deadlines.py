"""The proxy's read deadlines on a replica: each wait for a replica's next bytes fails
after ``--upstream-timeout-s`` of silence, whenever it began and however many other waits
share the pool's one timer; a wait answered in time is never failed, and the waits that
ended do not pile up behind one that is still pending."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from dataplane.transport.client import ConnectionPool, ReadDeadlines


@pytest.fixture
def silent_replica() -> Iterator[str]:
    """A replica that takes connections and requests and never answers: a listening
    socket nobody accepts on (the kernel completes the handshakes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"


async def test_a_replica_that_never_answers_is_given_up_after_the_read_timeout(
    silent_replica: str,
) -> None:
    pool = ConnectionPool(connect_timeout_s=5.0, read_timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer in time"):
        await pool.request("POST", silent_replica, b"{}", [("content-type", "application/json")])
    assert time.monotonic() - started >= 0.2  # never before its deadline
    assert pool.deadlines.pending == 0


async def test_each_wait_has_its_own_deadline_from_when_it_began() -> None:
    deadlines = ReadDeadlines(0.3)
    first = deadlines.waiter()
    await asyncio.sleep(0.15)  # the second wait begins later
    second = deadlines.waiter()
    with pytest.raises(TimeoutError):
        await first
    assert not second.done()  # its deadline is still ahead
    with pytest.raises(TimeoutError):
        await second


async def test_a_wait_answered_in_time_is_never_failed() -> None:
    deadlines = ReadDeadlines(0.1)
    answered, silent = deadlines.waiter(), deadlines.waiter()
    answered.set_result(None)
    with pytest.raises(TimeoutError):
        await silent  # the timer passed the answered wait's deadline on its way here
    assert answered.result() is None


async def test_ended_waits_do_not_pile_up_behind_a_pending_one() -> None:
    deadlines = ReadDeadlines(60.0)
    slow = deadlines.waiter()  # a replica still prefilling a long prompt, say
    for _ in range(10_000):  # short answers meanwhile, each wait ended at once
        deadlines.waiter().set_result(None)
        deadlines.pending -= 1
    assert deadlines.pending == 1
    assert len(deadlines) <= 4 * deadlines.pending + 65
    assert not slow.done()
    slow.cancel()


def test_deadlines_hold_on_a_new_event_loop() -> None:
    deadlines = ReadDeadlines(0.05)

    async def answered_wait() -> None:  # leaves its loop with the timer armed
        deadlines.waiter().set_result(None)

    async def silent_wait() -> None:
        async with asyncio.timeout(5):  # a bound on a failure: a lost timer never fires
            await deadlines.waiter()

    asyncio.run(answered_wait())
    with pytest.raises(TimeoutError, match="did not answer in time"):
        asyncio.run(silent_wait())
