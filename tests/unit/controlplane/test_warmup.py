"""The leader's warm-up (controlplane.fleet.warmup): who is warmed, with what, how fast,
and what a failure or a refusal does; what proxies are told while it runs."""

from __future__ import annotations

import asyncio
import random

import pytest

from controlplane.fleet.fleet import Fleet
from controlplane.fleet.fleet_view import replica_pb
from controlplane.fleet.warmup import Warmer, WarmupFailed, WarmupRefused
from kvcore.keys import chain_keys, root_key
from kvcore.pb import routing_pb2
from kvcore.workload import parse_workload
from tests.unit.controlplane.support import announce, batch, load

BS = 16
MODEL = "m"


class Engine:
    """A fake engine API: records what it is sent; stores the prefix as its KV events
    would (into the fleet), or fails as told."""

    def __init__(self, fleet: Fleet, fail: type[Exception] | None = None) -> None:
        self.fleet = fleet
        self.fail = fail
        self.sent: list[tuple[str, list[int]]] = []
        self.seq = 1

    async def send(self, base_url: str, model: str, token_ids: list[int]) -> None:
        self.sent.append((base_url, token_ids))
        if self.fail is not None:
            raise self.fail("no")
        replica = base_url.rsplit("/", 1)[1]
        keys = chain_keys(root_key(model=model), token_ids, BS)
        self.fleet.on_batch(batch(self.seq, stored=[keys], replica=replica), "default", 0.0)
        self.seq += 1


def fleet_with(*replicas: str) -> Fleet:
    fleet = Fleet(heartbeat_timeout_s=5.0)
    for replica in replicas:
        fleet.on_announce(announce(replica, model=MODEL), 0.0)
        fleet.on_batch(batch(0, replica=replica), "default", 0.0)  # in sync, holds nothing
    return fleet


def report(*prefixes: tuple[list[int], float]) -> routing_pb2.ProxyReport:
    msg = routing_pb2.ProxyReport(proxy_id="p1", ts=1.0, interval_s=1.0)
    for tokens, rate in prefixes:
        key = chain_keys(root_key(model=MODEL), tokens, BS)[-1]
        msg.hot_prefixes.add(
            workload="default",
            model=MODEL,
            token_ids=tokens,
            key=key,
            requests_per_s=rate,
            block_size=BS,
        )
    return msg


def tokens(blocks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(blocks * BS)]


def warmer(fleet: Fleet, engine: Engine, **warmup: object) -> Warmer:
    settings = {"enabled": True, "tokens_per_s": 1e9, **warmup}
    workload = parse_workload({"strategy": "kv_cost", "warmup": settings})
    return Warmer(fleet, lambda: [workload], lambda: True, engine.send)


async def settle(w: Warmer) -> None:
    for _ in range(20):
        w.tick()
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_an_empty_replica_is_warmed_most_valuable_first_and_confirmed() -> None:
    fleet = fleet_with("r1")
    engine = Engine(fleet)
    w = warmer(fleet, engine)
    small, large = tokens(4, 1), tokens(40, 2)
    w.on_report(report((small, 5.0), (large, 1.0)))  # values: 5 * 64 < 1 * 640 tokens
    await settle(w)
    assert [sent for _, sent in engine.sent] == [large, small]
    state = w.state_of("r1")
    assert state is not None and state["warming"] is False
    (summary,) = state["workloads"]  # type: ignore[misc]
    assert summary["outcome"] == "done" and summary["confirmed"] == 2
    assert fleet.by_id["r1"].warmup is None  # proxies told it is no longer warming
    await w.aclose()


@pytest.mark.asyncio
async def test_proxies_are_told_the_prefixes_being_warmed_until_confirmed() -> None:
    fleet = fleet_with("r1")
    gate = asyncio.Event()

    async def slow_send(base_url: str, model: str, token_ids: list[int]) -> None:
        await gate.wait()

    workload = parse_workload({"strategy": "kv_cost", "warmup": {"enabled": True}})
    w = Warmer(fleet, lambda: [workload], lambda: True, slow_send)
    prefix = tokens(8, 3)
    w.on_report(report((prefix, 1.0)))
    w.tick()
    sent = replica_pb(fleet.by_id["r1"])
    assert sent.warmup.warming
    assert list(sent.warmup.pending_keys) == [chain_keys(root_key(model=MODEL), prefix, BS)[-1]]
    gate.set()
    await w.aclose()


@pytest.mark.asyncio
async def test_a_replica_holding_blocks_is_not_warmed_and_nothing_goes_past_the_budget() -> None:
    fleet = fleet_with("r1", "r2")
    fleet.on_batch(batch(1, stored=[[1, 2, 3]], replica="r2"), "default", 0.0)
    engine = Engine(fleet)
    w = warmer(fleet, engine, max_tokens=40 * BS)
    w.on_report(report((tokens(30, 4), 1.0), (tokens(30, 5), 1.0)))
    await settle(w)
    assert {url.rsplit("/", 1)[1] for url, _ in engine.sent} == {"r1"}
    assert sum(len(t) for _, t in engine.sent) <= 40 * BS  # one of the two fits
    await w.aclose()


@pytest.mark.parametrize(
    ("fault", "sends", "outcome"),
    [(WarmupFailed, 3, "failed"), (WarmupRefused, 1, "refused")],
    ids=["three failures in a row end it", "a refusal ends it at once"],
)
@pytest.mark.asyncio
async def test_failures_are_counted_and_never_retried(
    fault: type[Exception], sends: int, outcome: str
) -> None:
    fleet = fleet_with("r1")
    engine = Engine(fleet, fail=fault)
    w = warmer(fleet, engine)
    w.on_report(report(*((tokens(4, seed), 1.0) for seed in range(6))))
    await settle(w)
    assert len(engine.sent) == sends and w.counters.failed == sends
    state = w.state_of("r1")
    assert state is not None and state["warming"] is False
    assert state["workloads"][0]["outcome"] == outcome  # type: ignore[index]
    await settle(w)
    assert len(engine.sent) == sends  # never retried
    await w.aclose()


@pytest.mark.asyncio
async def test_a_drained_replicas_lone_hot_prefix_is_sent_to_another_first() -> None:
    fleet = fleet_with("r1", "r2")
    engine = Engine(fleet)
    w = warmer(fleet, engine)
    lone = tokens(6, 7)
    fleet.on_batch(batch(1, stored=[chain_keys(root_key(model=MODEL), lone, BS)]), "default", 0)
    fleet.on_batch(batch(1, stored=[[9]], replica="r2"), "default", 0.0)
    w.on_report(report((lone, 1.0)))
    fleet.set_draining("r1", True)
    await settle(w)
    assert engine.sent == [(fleet.by_id["r2"].announce.base_url, lone)]  # type: ignore[union-attr]
    assert w.counters.rehomed == 1
    await w.aclose()


def test_malformed_hot_prefixes_are_counted_and_skipped() -> None:
    fleet = fleet_with("r1")
    w = warmer(fleet, Engine(fleet))
    bad = report((tokens(2, 8), 1.0))
    bad.hot_prefixes[0].token_ids.append(5)  # not whole blocks
    bad.hot_prefixes.add(workload="default", model=MODEL, token_ids=[1] * BS, block_size=0)
    bad.hot_prefixes.add(
        workload="default", model=MODEL, token_ids=[1] * BS, block_size=BS, requests_per_s=-1
    )
    w.on_report(bad)
    assert len(w.store) == 0 and w.store.rejected == 3


@pytest.mark.asyncio
async def test_replicas_joining_together_are_warmed_in_staggered_orders() -> None:
    fleet = fleet_with("r1", "r2")
    engine = Engine(fleet)
    w = warmer(fleet, engine)
    prefixes = [tokens(8, seed) for seed in (11, 12, 13)]
    w.on_report(report(*((p, 3.0 - i) for i, p in enumerate(prefixes))))
    await settle(w)
    sent = {url.rsplit("/", 1)[1]: [] for url, _ in engine.sent}
    for url, token_ids in engine.sent:
        sent[url.rsplit("/", 1)[1]].append(prefixes.index(token_ids))
    # not the same first, and each its share: r1 the prefix carrying half the requests,
    # r2 the others; together every prefix once
    assert sent == {"r1": [0], "r2": [1, 2]}
    await w.aclose()


@pytest.mark.asyncio
async def test_the_prefixes_whose_holders_queue_most_are_warmed_first() -> None:
    """A joiner is sent first the prefix whose holder is the most loaded (as its load
    reports say), before a more valuable one whose holder is idle."""
    fleet = fleet_with("busy", "idle")
    busy_prefix, idle_prefix = tokens(8, 21), tokens(8, 22)
    for replica, prefix in (("busy", busy_prefix), ("idle", idle_prefix)):
        keys = chain_keys(root_key(model=MODEL), prefix, BS)
        fleet.on_batch(batch(1, stored=[keys], replica=replica), "default", 0.0)
    fleet.on_load(load("busy", running=16), "default", 0.0)
    fleet.on_load(load("idle", running=0), "default", 0.0)
    engine = Engine(fleet)
    w = warmer(fleet, engine)
    w.on_report(report((busy_prefix, 1.0), (idle_prefix, 5.0)))
    fleet.on_announce(announce("new", model=MODEL), 0.0)
    fleet.on_batch(batch(0, replica="new"), "default", 0.0)
    await settle(w)
    assert [token_ids for _, token_ids in engine.sent] == [busy_prefix, idle_prefix]
    await w.aclose()


@pytest.mark.asyncio
async def test_the_plan_reads_each_prefixs_residency_once() -> None:
    """Planning a joiner reads each hot prefix's leading runs once (what the joiner
    holds and its holders' load come from the same read)."""
    fleet = fleet_with("old")
    prefixes = [tokens(8, 60 + i) for i in range(5)]
    for i, prefix in enumerate(prefixes):
        keys = chain_keys(root_key(model=MODEL), prefix, BS)
        fleet.on_batch(batch(1 + i, stored=[keys], replica="old"), "default", 0.0)
    w = warmer(fleet, Engine(fleet))
    w.on_report(report(*((p, 1.0) for p in prefixes)))
    fleet.on_announce(announce("new", model=MODEL), 0.0)
    fleet.on_batch(batch(0, replica="new"), "default", 0.0)
    reads = 0
    leading_runs = fleet.index.leading_runs

    def counted(keys: list[int], **kwargs: object) -> dict[int, int]:
        nonlocal reads
        reads += 1
        return leading_runs(keys, **kwargs)  # type: ignore[arg-type]

    fleet.index.leading_runs = counted  # type: ignore[method-assign]
    w.tick()  # plans the warm-up; its sends start after
    assert reads == len(prefixes)
    assert w.state_of("new")["workloads"][0]["planned"] == len(prefixes)  # type: ignore[index]
    await w.aclose()


@pytest.mark.asyncio
async def test_a_replica_that_joined_while_nothing_was_hot_is_warmed_once_something_is() -> None:
    fleet = fleet_with("r1")
    engine = Engine(fleet)
    w = warmer(fleet, engine)
    await settle(w)  # found empty, nothing hot yet: nothing to send
    assert engine.sent == [] and w.state_of("r1")["workloads"][0]["outcome"] == "nothing"  # type: ignore[index]
    assert w.counters.outcomes == {"nothing": 1}  # counted once, not at every check
    prefix = tokens(8, 70)
    w.on_report(report((prefix, 1.0)))  # it stays empty and a prefix becomes hot
    await settle(w)
    assert [sent for _, sent in engine.sent] == [prefix]
    assert w.state_of("r1")["workloads"][0]["outcome"] == "done"  # type: ignore[index]
    await w.aclose()


@pytest.mark.asyncio
async def test_stepping_down_ends_the_warm_ups_and_forgets_them() -> None:
    fleet = fleet_with("r1")
    wedged = asyncio.Event()
    leading = [True]

    async def hang(base_url: str, model: str, token_ids: list[int]) -> None:
        await wedged.wait()

    workload = parse_workload({"strategy": "kv_cost", "warmup": {"enabled": True}})
    w = Warmer(fleet, lambda: [workload], lambda: leading[0], hang)
    w.on_report(report((tokens(8, 4), 1.0)))
    w.tick()
    await asyncio.sleep(0)
    assert fleet.by_id["r1"].warmup  # proxies keep its prefix off it
    leading[0] = False
    w.step_down()
    assert fleet.by_id["r1"].warmup is None
    assert w.state_of("r1") is None and w.warming_count() == 0
    assert w.counters.outcomes == {"stepped_down": 1}
    leading[0] = True
    w.tick()  # leading again, the replica still empty: a new warm-up, a new send
    await asyncio.sleep(0)
    state = w.state_of("r1")
    assert state is not None and state["warming"] is True
    await w.aclose()
