"""``dataplane.lora``: where a workload with ``lora_on_miss: load`` puts an adapter, over
a real proxy fleet state and an upstream that records the engine calls."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from dataplane.fleet.state import FleetState
from dataplane.http_errors import BadRequest, NotFound
from dataplane.lora import AdapterLoadFailed, LoraPlacement
from kvcore.workload import parse_workload
from tests.unit.dataplane.state_messages import replica, snapshot

LOAD = parse_workload({"name": "w", "strategy": "kv_aware", "lora_on_miss": "load",
                       "lora_max_per_replica": 2})  # fmt: skip
REFUSE = parse_workload({"name": "w", "strategy": "kv_aware"})


class _Opened:
    def __init__(self, status: int) -> None:
        self.status, self.first = status, b"ok"

    async def next_chunk(self) -> bytes:
        return b""

    def release(self) -> None:
        pass


class Engines:
    """The replicas' engines as the placement calls them: every call recorded, each
    engine's adapters kept (unloading one it lacks is vLLM's 404)."""

    def __init__(self, held: dict[int, dict[str, str]]) -> None:
        self.calls: list[tuple[str, str]] = []  # (url, lora_name)
        self.held = {_url(o): set(adapters) for o, adapters in held.items()}
        self.refuse: int | None = None  # every load answered with this status

    async def open(self, method: str, url: str, body: bytes, headers: Any) -> _Opened:
        await asyncio.sleep(0)  # another request may run meanwhile
        name = json.loads(body)["lora_name"]
        self.calls.append((url, name))
        base, _, path = url.partition("/v1/")
        held = self.held.setdefault(base, set())
        if self.refuse is not None and path == "load_lora_adapter":
            return _Opened(self.refuse)
        if path == "unload_lora_adapter":
            if name not in held:
                return _Opened(404)
            held.discard(name)
        else:
            held.add(name)
        return _Opened(200)


def _url(ordinal: int) -> str:
    return f"http://127.0.0.1:{9000 + ordinal}"


def fleet_of(adapters: dict[int, dict[str, str]], running: dict[int, int]) -> FleetState:
    state = FleetState()
    replicas = []
    for ordinal in range(3):
        info = replica(ordinal, running=running.get(ordinal, 0), report_ts=1.0, capacity=10)
        info.lora_adapters.update(adapters.get(ordinal, {}))
        replicas.append(info)
    for update in snapshot(1, 1, replicas):
        state.apply(update)
    return state


def placement(
    state: FleetState, held: dict[int, dict[str, str]] | None = None
) -> tuple[LoraPlacement, Engines]:
    engines = Engines(held or {})
    return LoraPlacement(state, engines, clock=lambda: 100.0), engines  # type: ignore[arg-type]


async def test_a_missing_adapter_is_loaded_once_onto_the_least_loaded_replica() -> None:
    state = fleet_of({0: {"sql": "/a/sql"}}, {0: 1, 1: 5, 2: 1})
    lora, engines = placement(state)
    unloaded = [
        replica(o, running=r, report_ts=2.0, capacity=10) for o, r in ((0, 1), (1, 5), (2, 1))
    ]
    state.apply(snapshot(2, 1, unloaded)[0])
    assert lora.names_adapter("sql")  # remembered after its holder unloaded it
    assert await lora.place("sql", REFUSE) is None  # refused: the router answers 404
    burst = await asyncio.gather(*(lora.place("sql", LOAD) for _ in range(5)))
    assert set(burst) in ({0}, {2}) and len(engines.calls) == 1
    assert engines.calls[0][0].endswith("/v1/load_lora_adapter")


async def test_a_replica_at_its_bound_unloads_the_adapter_routed_to_least_recently() -> None:
    # c's only holder and replica 2 are saturated: c goes to replica 0, at its bound of 2
    held = {0: {"a": "/a", "b": "/b"}, 1: {"c": "/c"}}
    state = fleet_of(held, {1: 9, 2: 9})
    lora, engines = placement(state, held)
    lora.routed("b", 0)
    lora.routed("a", 0)  # b is now the least recently routed on replica 0
    assert await lora.place("c", LOAD) == 0
    assert [name for _, name in engines.calls] == ["b", "c"]  # unload b, then load c
    assert engines.calls[0][0].endswith("/v1/unload_lora_adapter")


async def test_every_holder_saturated_adds_a_replica() -> None:
    state = fleet_of({0: {"sql": "/a/sql"}}, {0: 10})
    lora, engines = placement(state)
    assert await lora.place("sql", LOAD) in (1, 2)
    assert [name for _, name in engines.calls] == ["sql"]


async def test_the_pool_routes_check_names_and_act_on_every_replica() -> None:
    held = {0: {"sql": "/a/sql"}}
    state = fleet_of(held, {})
    lora, engines = placement(state, held)
    with pytest.raises(BadRequest):
        await lora.admin("/v1/load_lora_adapter", b'{"lora_name": "a b", "lora_path": "/x"}', {})
    text = await lora.admin("/v1/load_lora_adapter", b'{"lora_name": "x", "lora_path": "/x"}', {})
    assert text == "Success: LoRA adapter 'x' added successfully."
    assert all("x" in adapters for adapters in engines.held.values())
    assert len(engines.held) == 3
    await lora.admin("/v1/unload_lora_adapter", b'{"lora_name": "sql"}', {})
    assert not any("sql" in adapters for adapters in engines.held.values())
    with pytest.raises(NotFound):  # asked everywhere, held nowhere
        await lora.admin("/v1/unload_lora_adapter", b'{"lora_name": "nowhere"}', {})


@pytest.mark.parametrize(("engine_status", "proxy_status"), [(404, 404), (500, 502)])
async def test_a_refused_load_is_the_clients_404_and_a_failed_one_a_502(
    engine_status: int, proxy_status: int
) -> None:
    """vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING has no load route (404): the
    adapter cannot be had, as if unknown; an engine failing (500) is the proxy's 502."""
    state = fleet_of({}, {})
    lora, engines = placement(state)
    lora._remember("sql", "/a/sql")  # seen announced once
    engines.refuse = engine_status
    with pytest.raises((NotFound, AdapterLoadFailed)) as refused:
        await lora.place("sql", LOAD)
    assert refused.value.status == proxy_status
    if proxy_status == 404:
        assert refused.value.code == "model_not_found"
