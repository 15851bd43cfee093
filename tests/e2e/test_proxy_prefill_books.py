"""The proxy's prefill books in front of real kvroute-sim replicas that take real time to
prefill (20,000 tokens/s): a ``kv_cost`` proxy sees the prefill it has queued on a
replica before any load report could, and every way a request ends settles its ticket.

The proxy runs in process on a real port (``test_proxy_state_routing``'s harness), its
state applied from real ``routing.proto`` messages.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import aiohttp
import pytest
from prometheus_client import generate_latest

from dataplane.service import ProxyService
from tests.e2e.test_proxy_state_routing import MODEL, proxy, routing_state
from tests.unit.dataplane.state_messages import load
from tests.unit.enginesim.simproc import SimProcess

pytestmark = pytest.mark.e2e

RATE = 20_000  # the sims' prefill tokens per second, and the workload's
KV_COST = {"name": "default", "strategy": "kv_cost", "prefill_tokens_per_s": RATE}
AUTH = {"authorization": "Bearer alpha-secret"}
SHARED = list(range(1000, 3000))  # a 2,000-token prefix
LONG_TAIL = list(range(5000, 17000))  # 12,000 tokens nobody holds: 0.6 s of prefill


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    args = (
        f"--model={MODEL}", "--max-model-len=16384", "--replay-endpoint=",
        f"--prefill-rate={RATE}", "--prefill-overhead-ms=0", "--decode-base-ms=1",
    )  # fmt: skip
    with ExitStack() as stack:
        yield [stack.enter_context(SimProcess(*args)) for _ in range(2)]


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int] | list[list[int]],
    *,
    stream: bool = False,
) -> tuple[int, str, bytes]:
    """``(status, replica, body)`` of one completion of ``prompt`` (token ids, or a batch
    of them)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body, headers=AUTH) as response:
        return response.status, response.headers.get("x-kvroute-replica", ""), await response.read()


def queued(service: ProxyService) -> dict[str, float | None]:
    return {
        r.replica_id: r.queued_prefill_tokens for r in service.fleet.views.view(MODEL).replicas()
    }


def open_tickets(service: ProxyService) -> int:
    books = service.fleet._books
    return sum(books.pending(key) for key in service.fleet.replicas._ledger_keys.values())


def metrics(service: ProxyService) -> str:
    return generate_latest(service.metrics.registry).decode()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll the in-process proxy's state (the event loop runs it meanwhile), up to 5 s."""
    for _ in range(2500):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"not within 5 s: {what}")


async def test_a_replica_busy_prefilling_for_this_proxy_is_passed_over(
    sims: list[SimProcess],
) -> None:
    """The replica holding the shared prefix is prefilling 12,000 new tokens for this
    proxy: a new prompt on that prefix would wait up to 0.6 s there and takes 0.1 s to
    recompute on the idle one, so kv_cost sends it there (if routed within 0.5 s of the
    long prompt). Counted in requests, as without the books, the busy replica's queue is
    one request of 1,024 tokens and the prefix would win."""
    async with (
        proxy(routing_state(sims, KV_COST)) as (url, service),
        aiohttp.ClientSession() as session,
    ):
        status, holder, _ = await complete(session, url, SHARED)  # warm the prefix
        assert status == 200
        long_request = asyncio.ensure_future(
            complete(session, url, SHARED + LONG_TAIL, stream=True)
        )
        await until(lambda: service.fleet.inflight.total() == 1, "the long prompt sent")
        status, landed, _ = await complete(session, url, [*SHARED, *range(20, 70)])
        assert status == 200 and landed != holder
        status, long_replica, _ = await long_request
        assert status == 200 and long_replica == holder
    assert open_tickets(service) == 0
    assert set(queued(service).values()) == {0}


async def test_a_batchs_long_later_prompt_counts_on_its_replica(sims: list[SimProcess]) -> None:
    """A completion batch is routed by its first prompt, the warm prefix, but its second
    prompt brings 12,000 new tokens to the same replica. The books count them (the
    prefix's 2,000 tokens, resident and the first prompt's, are not), so the next prompt
    on that prefix is passed over to the idle replica, as behind one long prompt."""
    async with (
        proxy(routing_state(sims, KV_COST)) as (url, service),
        aiohttp.ClientSession() as session,
    ):
        status, holder, _ = await complete(session, url, SHARED)  # warm the prefix
        assert status == 200
        batch = asyncio.ensure_future(complete(session, url, [SHARED, SHARED + LONG_TAIL]))
        await until(lambda: service.fleet.inflight.total() == 1, "the batch sent")
        assert 11_000 < (queued(service)[holder] or 0) <= len(LONG_TAIL) + 16
        status, landed, _ = await complete(session, url, [*SHARED, *range(20, 70)])
        assert status == 200 and landed != holder
        status, batch_replica, answer = await batch
        assert status == 200 and batch_replica == holder, answer
        assert [choice["index"] for choice in json.loads(answer)["choices"]] == [0, 1]
    assert open_tickets(service) == 0
    assert set(queued(service).values()) == {0}


async def test_failed_refused_retried_and_cancelled_requests_leave_no_tokens(
    sims: list[SimProcess],
) -> None:
    """A replica nobody listens on (retried on a live one), an engine answering 500, and a
    client that goes away in the middle of a long prefill: afterwards no ticket is open."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    updates = routing_state(sims, KV_COST)
    updates[0].snapshot.replicas[0].base_url = dead_url  # r0: nobody listens
    updates[0].snapshot.replicas[1].load.CopyFrom(load(8, 0, ts=time.time()))
    async with proxy(updates) as (url, service), aiohttp.ClientSession() as session:
        statuses = [(await complete(session, url, [7, i, *SHARED]))[0] for i in range(4)]
        assert statuses == [200] * 4  # every one landed on the live replica in the end
        # new prompts go to the replicas in turn, and a retry moves the turn on: at least
        # every other one was tried on r0 first
        retries = re.search(
            r'kvroute_proxy_retries_total\{reason="connect"\} (\S+)', metrics(service)
        )
        assert retries is not None and 2 <= float(retries.group(1)) <= 4
        assert open_tickets(service) == 0
        await _fail_next_request(session, sims[1])
        status, _, body = await complete(session, url, SHARED)
        assert status == 500, body
        assert open_tickets(service) == 0
        cancelled = asyncio.ensure_future(complete(session, url, LONG_TAIL, stream=True))
        await until(lambda: (queued(service)["r1"] or 0) > 0, "the long prompt booked")
        cancelled.cancel()
        await until(lambda: service.fleet.inflight.total() == 0, "the cancelled request ended")
        assert open_tickets(service) == 0


async def _fail_next_request(session: aiohttp.ClientSession, sim: SimProcess) -> None:
    async with session.post(f"{sim.url}/sim/faults", json={"fail_requests": 1}) as response:
        assert response.status == 200, json.loads(await response.read())
