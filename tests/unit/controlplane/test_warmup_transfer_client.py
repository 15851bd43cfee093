"""The warm-up's transfer pair over HTTP (controlplane.fleet.warmup_transfer): what each
engine is sent, and that any half failing is a failure the warmer falls back from."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controlplane.fleet.warmup import WarmupFailed
from controlplane.fleet.warmup_transfer import EngineTransfers

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e1"}


class Engines:
    """Two fake engines on one server: /source (prefill side) and /target."""

    def __init__(self) -> None:
        self.bodies: dict[str, dict[str, Any]] = {}
        self.source_params: dict[str, Any] | None = PARAMS
        self.target_status = 200

    async def source(self, request: web.Request) -> web.Response:
        self.bodies["source"] = await request.json()
        answer: dict[str, Any] = {"choices": [{"text": "x"}]}
        if self.source_params is not None:
            answer["kv_transfer_params"] = self.source_params
        return web.json_response(answer)

    async def target(self, request: web.Request) -> web.Response:
        self.bodies["target"] = await request.json()
        return web.json_response({"choices": [{"text": "x"}]}, status=self.target_status)


@pytest.fixture
async def served() -> AsyncIterator[tuple[Engines, str]]:
    engines = Engines()
    app = web.Application()
    app.router.add_post("/source/v1/completions", engines.source)
    app.router.add_post("/target/v1/completions", engines.target)
    async with TestServer(app, host="127.0.0.1") as server:
        yield engines, str(server.make_url("")).rstrip("/")


@pytest.mark.asyncio
async def test_the_target_is_sent_the_parameters_the_source_answered(
    served: tuple[Engines, str],
) -> None:
    engines, url = served
    client = EngineTransfers()
    await client.move(f"{url}/source", f"{url}/target", "m", [1, 2, 3])
    source, target = engines.bodies["source"], engines.bodies["target"]
    assert source["prompt"] == target["prompt"] == [1, 2, 3]
    assert source["max_tokens"] == target["max_tokens"] == 1
    assert source["kv_transfer_params"]["do_remote_decode"] is True
    assert target["kv_transfer_params"] == PARAMS
    await client.aclose()


@pytest.mark.parametrize("fault", ["no connector on the source", "the target refuses"])
@pytest.mark.asyncio
async def test_either_half_failing_is_a_failure_to_fall_back_from(
    served: tuple[Engines, str], fault: str
) -> None:
    engines, url = served
    if fault == "no connector on the source":
        engines.source_params = None
    else:
        engines.target_status = 400
    client = EngineTransfers()
    with pytest.raises(
        WarmupFailed, match="kv_both" if engines.source_params is None else "target"
    ):
        await client.move(f"{url}/source", f"{url}/target", "m", [1, 2, 3])
    assert ("target" in engines.bodies) is (engines.source_params is not None)
    await client.aclose()
