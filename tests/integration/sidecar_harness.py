"""Harness for the sidecar's integration tests: the service in-process, a fake engine's
HTTP side, and a NATS subscriber that mirrors what a control plane would know."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from aiohttp import web
from nats.aio.msg import Msg

from kvcore import subjects
from kvcore.pb import events_pb2
from kvroute.servers import free_port
from sidecar.service import SidecarService
from sidecar.settings import SidecarSettings
from tests.unit.sidecar.support import ResidencyMirror

VLLM_METRICS = """# HELP vllm:num_requests_running running
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="512"} 1.0
"""


async def wait_until(predicate: Callable[[], bool], deadline_s: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``deadline_s``."""
    async with asyncio.timeout(deadline_s):
        while True:
            if predicate():
                return
            await asyncio.sleep(0.02)


@dataclass
class EngineHttpStub:
    """The engine's HTTP side: ``/metrics`` with vLLM names, switchable off."""

    up: bool = True
    port: int = field(default_factory=free_port)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        async def metrics(request: web.Request) -> web.Response:
            if not self.up:
                return web.Response(status=503)
            return web.Response(text=VLLM_METRICS)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class Watcher:
    """Subscribes like a control plane: events into a mirror, announces and loads kept."""

    nats_url: str
    pool: str = "default"
    replica: str = "r1"
    mirror: ResidencyMirror = field(default_factory=ResidencyMirror)
    announces: list[events_pb2.ReplicaAnnounce] = field(default_factory=list)
    loads: list[events_pb2.LoadReport] = field(default_factory=list)
    nc: Any = None

    async def start(self) -> None:
        self.nc = await nats.connect(
            self.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.1
        )

        async def on_events(msg: Msg) -> None:
            self.mirror.apply(msg.data)

        async def on_announce(msg: Msg) -> None:
            self.announces.append(events_pb2.ReplicaAnnounce.FromString(msg.data))

        async def on_load(msg: Msg) -> None:
            self.loads.append(events_pb2.LoadReport.FromString(msg.data))

        await self.nc.subscribe(subjects.events_subject(self.pool, self.replica), cb=on_events)
        await self.nc.subscribe(subjects.announce_subject(self.pool), cb=on_announce)
        await self.nc.subscribe(subjects.load_subject(self.pool, self.replica), cb=on_load)
        await self.nc.flush()

    async def resync(self, snapshot_id: int) -> events_pb2.ResyncReply:
        request = events_pb2.ResyncRequest(requester="test", reason="test", snapshot_id=snapshot_id)
        msg = await self.nc.request(
            subjects.resync_subject(self.pool, self.replica), request.SerializeToString(), timeout=5
        )
        return events_pb2.ResyncReply.FromString(msg.data)

    async def stop(self) -> None:
        await self.nc.close()


def sidecar_settings(**overrides: Any) -> SidecarSettings:
    values: dict[str, Any] = {
        "replica_id": "r1",
        "model": "m",
        "port": 0,
        "replay_timeout_s": 0.5,
        "announce_interval_s": 10.0,
        "load_interval_s": 0.1,
    }
    return SidecarSettings(**(values | overrides))


@contextlib.asynccontextmanager
async def running_sidecar(settings: SidecarSettings) -> AsyncIterator[SidecarService]:
    service = SidecarService(settings)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await wait_until(lambda: service.source is not None and service.source.caught_up.is_set())
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
