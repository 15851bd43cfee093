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


def fleet_of(joiner_kind: int = events_pb2.ENGINE_KIND_VLLM, waiting: int = 0) -> Fleet:
    """r1 joins empty; r2 and r3 are up (holding a block: not warmed), r2 the busier,
    each with ``waiting`` requests waiting."""
    fleet = Fleet(heartbeat_timeout_s=5.0)
    for replica in ("r1", "r2", "r3"):
        msg = announce(replica, model=MODEL)
        if replica == "r1":
            msg.engine_kind = joiner_kind
        fleet.on_announce(msg, 0.0)
        fleet.on_batch(batch(0, replica=replica), "default", 0.0)
    fleet.on_batch(batch(1, stored=[[7]], replica="r2"), "default", 0.0)
    fleet.on_batch(batch(1, stored=[[8]], replica="r3"), "default", 0.0)
    fleet.on_load(load("r2", running=12, waiting=waiting), "default", 0.0)
    fleet.on_load(load("r3", running=1, waiting=waiting), "default", 0.0)
    return fleet


def hold(fleet: Fleet, replica: str, token_ids: list[int], seq: int = 2) -> None:
    keys = chain_keys(root_key(model=MODEL), token_ids, BS)
    fleet.on_batch(batch(seq, stored=[keys], replica=replica), "default", 0.0)


def held_by_both(fleet: Fleet, seed: int, seq: int = 2) -> list[int]:
    """A prefix r2 and r3 hold (``seq``: their event batches' number)."""
    prefix = tokens(8, seed)
    hold(fleet, "r2", prefix, seq)
    hold(fleet, "r3", prefix, seq)
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
    assert mover.moved == [("r3", "r1", prefix)]  # r3: 1 running, r2: 12
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


@pytest.mark.asyncio
async def test_an_idle_joiner_computes_one_prefix_whose_holders_queue_the_rest_move() -> None:
    fleet = fleet_of(waiting=3)  # a saturated fleet: a move waits there for a free slot
    prefixes = [held_by_both(fleet, 40 + i, seq=2 + i) for i in range(4)]
    engine, mover = Engine(fleet), Mover(fleet)
    gate = mover.gate = asyncio.Event()

    async def computing(base_url: str, model: str, token_ids: list[int]) -> None:
        await gate.wait()  # the joiner's prefill takes a while
        await engine.send(base_url, model, token_ids)

    settings = {"enabled": True, "tokens_per_s": 1e9, "source": "transfer"}
    workload = parse_workload({"strategy": "kv_cost", "warmup": settings})
    w = Warmer(fleet, lambda: [workload], lambda: True, computing, move=mover.move)
    w.on_report(report(*((p, 1.0) for p in prefixes)))
    await settle(w)
    # one computed by the idle joiner, the others moved meanwhile, none both
    moved = [t for _, _, t in mover.moved]
    assert len(moved) == 3
    gate.set()
    await settle(w)
    computed = [t for _, t in engine.sent]
    assert len(computed) == 1 and sorted(computed + moved) == sorted(prefixes)
    assert (w.counters.moved, w.counters.fell_back) == (3, 1)
    assert w.state_of("r1")["workloads"][0]["confirmed"] == 4  # type: ignore[index]
    await w.aclose()


@pytest.mark.asyncio
async def test_a_joiner_serving_requests_moves_what_it_can() -> None:
    fleet = fleet_of(waiting=3)
    fleet.on_load(load("r1", running=2, waiting=0), "default", 0.0)  # busy: no compute
    prefix = held_by_both(fleet, 45)
    engine, mover = Engine(fleet), Mover(fleet)
    w = warmer(fleet, engine, mover)
    w.on_report(report((prefix, 1.0)))
    await settle(w)
    assert [t for _, _, t in mover.moved] == [prefix] and engine.sent == []
    await w.aclose()


@pytest.mark.asyncio
async def test_an_sglang_joiner_is_warmed_by_recompute_one_prefix_at_a_time() -> None:
    fleet = fleet_of(events_pb2.ENGINE_KIND_SGLANG)
    prefixes = [held_by_both(fleet, 50 + i, seq=2 + i) for i in range(4)]
    gate = asyncio.Event()
    in_flight = most = 0
    sent: list[list[int]] = []

    async def send(base_url: str, model: str, token_ids: list[int]) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        sent.append(token_ids)
        await gate.wait()
        in_flight -= 1
        hold(fleet, "r1", token_ids, seq=10 + len(sent))

    settings = {"enabled": True, "tokens_per_s": 1e9, "source": "transfer"}
    workload = parse_workload({"strategy": "kv_cost", "warmup": settings})
    mover = Mover(fleet)
    w = Warmer(fleet, lambda: [workload], lambda: True, send, move=mover.move)
    w.on_report(report(*((p, 1.0) for p in prefixes)))
    await settle(w)
    assert in_flight == 1  # the recompute path's one at a time, not the moves' 8
    gate.set()
    await settle(w)
    assert most == 1 and len(sent) == 4 and mover.moved == []
    assert w.counters.fell_back == 4
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
