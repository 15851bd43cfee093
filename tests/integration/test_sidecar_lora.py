"""The sidecar and LoRA adapters, with real NATS and a real ``kvroute-sim``: it announces
the adapters the engine has loaded (and their loads and unloads within a load interval),
and keys an adapter's blocks under the adapter, as the proxy keys its requests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvcore.keys import block_keys
from kvroute.servers import NatsServer
from tests.integration.sidecar_harness import (
    SimProcess,
    Watcher,
    running_sidecar,
    sidecar_settings,
    wait_until,
)

pytestmark = pytest.mark.integration
PROMPT = list(range(4_000, 4_067))  # 4 full blocks of 16


# event format, page size, start-up flag, the model name of adapter sql, the routes' prefix
ENGINES = {
    "vllm": ("vllm", 16, "--lora-modules", "sql", "/v1"),
    "sglang": ("sglang", 1, "--lora-paths", "m:sql", ""),
}


@pytest.fixture(params=sorted(ENGINES))
async def engine(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[SimProcess, str, str]]:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    event_format, page, flag, model, routes = ENGINES[request.param]
    extra = ("--enable-lora", flag, "sql=/adapters/sql")
    process = await SimProcess(event_format, page, 4096, extra=extra).start()
    yield process, model, routes
    await process.stop()


async def post(sim: SimProcess, path: str, body: object) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim.http_url + path, json=body) as response,
    ):
        return response.status


async def test_adapters_are_announced_and_their_blocks_keyed_under_them(
    nats_server: NatsServer, watcher: Watcher, engine: tuple[SimProcess, str, str]
) -> None:
    sim, model, routes = engine
    settings = sidecar_settings(
        engine_kind="sglang" if sim.event_format == "sglang" else "vllm",
        engine_url=sim.http_url,
        kv_events_endpoint=sim.events,
        replay_endpoint=sim.replay,
        nats_url=nats_server.url,
        replica_id=watcher.replica,
    )

    def adapters() -> dict[str, str]:
        return dict(watcher.announces[-1].lora_adapters) if watcher.announces else {}

    async with running_sidecar(settings):
        await wait_until(lambda: adapters() == {"sql": "/adapters/sql"})
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
        assert await post(sim, "/v1/completions", body) == 200
        keyed = set(block_keys(PROMPT, model="m", lora_name="sql"))
        await wait_until(lambda: keyed <= watcher.mirror.gpu_keys())
        assert not set(block_keys(PROMPT, model="m")) & watcher.mirror.gpu_keys()

        load = {"lora_name": "chat", "lora_path": "/adapters/chat"}
        assert await post(sim, f"{routes}/load_lora_adapter", load) == 200
        await wait_until(lambda: "chat" in adapters())
        assert await post(sim, f"{routes}/unload_lora_adapter", {"lora_name": "sql"}) == 200
        await wait_until(lambda: adapters() == {"chat": "/adapters/chat"})
