"""Warm-up by KV transfer (``warmup.source: transfer``): which replica a prefix is moved
from, how many move at once, and when the warmer recomputes instead."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.fleet.fleet import Fleet
from controlplane.fleet.warmup import Warmer, WarmupFailed
from kvcore.keys import chain_keys, root_key
from kvcore.pb import events_pb2
from kvcore.warmup import TRANSFERS_IN_FLIGHT
from kvcore.workload import parse_workload
from tests.unit.controlplane.support import announce, batch, load
from tests.unit.controlplane.test_warmup import BS, MODEL, Engine, report, settle, tokens


class Mover:
    """A fake pair of engines moving a prefix: records (source, target, tokens); the
    target stores it as its KV events would, or the move fails as told."""

    def __init__(self, fleet: Fleet, fail: bool = False) -> None:
        self.fleet, self.fail = fleet, fail
        self.moved: list[tuple[str, str, list[int]]] = []
        self.gate: asyncio.Event | None = None
        self.in_flight = self.most_in_flight = 0
        self.seq = 100

    async def move(self, source: str, target: str, model: str, token_ids: list[int]) -> None:
        self.moved.append((_name(source), _name(target), token_ids))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.fail:
                raise WarmupFailed("no kv_transfer_params")
        finally:
            self.in_flight -= 1
        keys = chain_keys(root_key(model=model), token_ids, BS)
        self.fleet.on_batch(batch(self.seq, stored=[keys], replica=_name(target)), "default", 0)
        self.seq += 1


def _name(url: str) -> str:
    return url.rsplit("/", 1)[1]


def fleet_of(joiner_kind: int = events_pb2.ENGINE_KIND_VLLM) -> Fleet:
    """r1 joins empty; r2 and r3 are up (holding a block: not warmed), r2 the busier."""
    fleet = Fleet(heartbeat_timeout_s=5.0)
    for replica in ("r1", "r2", "r3"):
        msg = announce(replica, model=MODEL)
        if replica == "r1":
            msg.engine_kind = joiner_kind
        fleet.on_announce(msg, 0.0)
        fleet.on_batch(batch(0, replica=replica), "default", 0.0)
    fleet.on_batch(batch(1, stored=[[7]], replica="r2"), "default", 0.0)
    fleet.on_batch(batch(1, stored=[[8]], replica="r3"), "default", 0.0)
    fleet.on_load(load("r2", running=12), "default", 0.0)
    fleet.on_load(load("r3", running=1), "default", 0.0)
    return fleet


def hold(fleet: Fleet, replica: str, token_ids: list[int], seq: int = 2) -> None:
    keys = chain_keys(root_key(model=MODEL), token_ids, BS)
    fleet.on_batch(batch(seq, stored=[keys], replica=replica), "default", 0.0)


def held_by_both(fleet: Fleet, seed: int) -> list[int]:
    """A prefix r2 and r3 hold."""
    prefix = tokens(8, seed)
    hold(fleet, "r2", prefix)
    hold(fleet, "r3", prefix)
    return prefix


def warmer(fleet: Fleet, engine: Engine, mover: Mover, source: str = "transfer") -> Warmer:
    settings = {"enabled": True, "tokens_per_s": 1e9, "source": source}
    workload = parse_workload({"strategy": "kv_cost", "warmup": settings})
    return Warmer(fleet, lambda: [workload], lambda: True, engine.send, move=mover.move)


@pytest.mark.asyncio
async def test_a_prefix_is_moved_from_the_least_loaded_replica_holding_it() -> None:
    fleet = fleet_of()
    prefix = held_by_both(fleet, 21)
    engine, mover = Engine(fleet), Mover(fleet)
    w = warmer(fleet, engine, mover)
    w.on_report(report((prefix, 1.0)))
    await settle(w)
    assert mover.moved == [("r3", "r1", prefix)]  # r3: 1 running + 2 waiting, r2: 14
    assert engine.sent == []  # nothing recomputed
    assert (w.counters.moved, w.counters.fell_back, w.counters.sent) == (1, 0, 1)
    state = w.state_of("r1")
    assert state is not None and state["warming"] is False
    assert state["workloads"][0]["outcome"] == "done"  # type: ignore[index]
    assert state["workloads"][0]["confirmed"] == 1  # type: ignore[index]
    await w.aclose()


@pytest.mark.asyncio
async def test_a_prefix_nobody_holds_or_whose_move_fails_is_recomputed_and_counted() -> None:
    fleet = fleet_of()
    held, lone = tokens(8, 22), tokens(8, 23)
    hold(fleet, "r2", held)
    engine, mover = Engine(fleet), Mover(fleet, fail=True)
    w = warmer(fleet, engine, mover)
    w.on_report(report((held, 2.0), (lone, 1.0)))
    await settle(w)
    assert [source for source, _, _ in mover.moved] == ["r2"]  # only the held one is tried
    assert sorted(t for _, t in engine.sent) == sorted([held, lone])  # both recomputed
    assert {_name(url) for url, _ in engine.sent} == {"r1"}
    assert (w.counters.moved, w.counters.fell_back, w.counters.failed) == (0, 2, 0)
    assert w.state_of("r1")["workloads"][0]["outcome"] == "done"  # type: ignore[index]
    await w.aclose()


@pytest.mark.parametrize("source", ["recompute", "sglang joiner"])
@pytest.mark.asyncio
async def test_recompute_or_an_sglang_replica_never_moves(source: str) -> None:
    sglang = source == "sglang joiner"
    fleet = fleet_of(events_pb2.ENGINE_KIND_SGLANG if sglang else events_pb2.ENGINE_KIND_VLLM)
    prefix = tokens(8, 24)
    hold(fleet, "r2", prefix)
    engine, mover = Engine(fleet), Mover(fleet)
    w = warmer(fleet, engine, mover, source="transfer" if sglang else "recompute")
    w.on_report(report((prefix, 1.0)))
    await settle(w)
    assert mover.moved == [] and [t for _, t in engine.sent] == [prefix]
    assert w.counters.fell_back == (1 if sglang else 0)
    await w.aclose()


@pytest.mark.asyncio
async def test_an_sglang_or_draining_holder_is_not_a_source() -> None:
    fleet = fleet_of()
    prefix = held_by_both(fleet, 25)
    sglang = announce("r2", model=MODEL)
    sglang.engine_kind = events_pb2.ENGINE_KIND_SGLANG
    fleet.on_announce(sglang, 0.0)
    fleet.set_draining("r3", True)
    engine, mover = Engine(fleet), Mover(fleet)
    w = warmer(fleet, engine, mover)
    w.on_report(report((prefix, 1.0)))
    await settle(w)
    assert mover.moved == [] and [_name(url) for url, _ in engine.sent] == ["r1"]
    await w.aclose()


@pytest.mark.asyncio
async def test_moves_run_at_once_up_to_the_bound_and_all_end() -> None:
    fleet = fleet_of()
    prefixes = [tokens(2, 30 + i) for i in range(TRANSFERS_IN_FLIGHT + 4)]
    for i, prefix in enumerate(prefixes):
        hold(fleet, "r3", prefix, seq=2 + i)
    engine, mover = Engine(fleet), Mover(fleet)
    mover.gate = asyncio.Event()
    w = warmer(fleet, engine, mover)
    w.on_report(report(*((p, 1.0) for p in prefixes)))
    await settle(w)
    assert mover.in_flight == TRANSFERS_IN_FLIGHT  # not one at a time, not unbounded
    mover.gate.set()
    await settle(w)
    assert len(mover.moved) == len(prefixes) and mover.most_in_flight == TRANSFERS_IN_FLIGHT
    state = w.state_of("r1")
    assert state is not None and state["warming"] is False
    assert state["workloads"][0]["confirmed"] == len(prefixes)  # type: ignore[index]
    await w.aclose()
