"""Harness for the sidecar's integration tests: the service in-process, a fake engine's
HTTP side, a real ``kvroute-sim`` process, and a NATS subscriber that mirrors what a
control plane would know.

The oracle for "published state equals the engine's cache" is independent of the
sidecar: the sim's ``/sim/state`` lists the engine hashes it caches, and
:class:`PromptBook` maps them back to router keys through the engine's own hash chain
(``enginesim.hashing``) and ``kvcore.keys.block_keys`` of the prompts that were sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
from aiohttp import web
from nats.aio.msg import Msg

from enginesim.hashing import prompt_digests
from enginesim.wire import make_format
from kvcore import subjects
from kvcore.engine_events import normalize_hash
from kvcore.keys import block_keys
from kvcore.pb import events_pb2
from kvroute.servers import free_port
from kvruntime.nats import subscriptions_live
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


async def wait_until(predicate: Callable[[], bool], deadline_s: float = 30.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``deadline_s`` (a bound on a failure,
    not a speed assertion: a loaded machine may take several seconds)."""
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
        assert await subscriptions_live(self.nc, timeout_s=30)

    async def resync(self, snapshot_id: int) -> events_pb2.ResyncReply:
        request = events_pb2.ResyncRequest(requester="test", reason="test", snapshot_id=snapshot_id)
        msg = await self.nc.request(
            subjects.resync_subject(self.pool, self.replica),
            request.SerializeToString(),
            timeout=30,
        )
        return events_pb2.ResyncReply.FromString(msg.data)

    async def stop(self) -> None:
        await self.nc.close()


def _bound_port_nobody_listens_on() -> socket.socket:
    """A loopback port held for the whole test session and never listened on, so a
    connect to it is refused at once and no other server can take it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


_NO_ENGINE = _bound_port_nobody_listens_on()
NO_ENGINE_URL = f"http://127.0.0.1:{_NO_ENGINE.getsockname()[1]}"
"""Where a sidecar under test finds no engine HTTP side. Its default, 127.0.0.1:8000, is
whatever else runs here (``kvroute up``'s proxy, say), and a first-contact replay probe
answered by that raced the test's own frames."""


def sidecar_settings(**overrides: Any) -> SidecarSettings:
    values: dict[str, Any] = {
        "replica_id": "r1",
        "engine_url": NO_ENGINE_URL,
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
        await asyncio.wait_for(task, timeout=30)


SIM_BIN = Path(sys.executable).parent / "kvroute-sim"


@dataclass
class SimProcess:
    """A real ``kvroute-sim`` process; ready once it prints its ready line."""

    event_format: str
    block_size: int = 16
    num_blocks: int = 4096
    ports: tuple[int, int, int] | None = None  # fixed ports, to restart in place
    extra: tuple[str, ...] = ()  # more flags
    http_url: str = ""
    events: str = ""
    replay: str = ""
    proc: asyncio.subprocess.Process | None = None

    def _args(self) -> list[str]:
        http, events, replay = self.ports or (0, 0, 0)
        return [
            str(SIM_BIN),
            "--model",
            "m",
            "--instant",
            "--port",
            str(http),
            "--block-size",
            str(self.block_size),
            "--num-blocks",
            str(self.num_blocks),
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{events}",
            "--replay-endpoint",
            f"tcp://127.0.0.1:{replay}",
            "--event-format",
            self.event_format,
            *self.extra,
        ]

    async def start(self) -> SimProcess:
        self.proc = await asyncio.create_subprocess_exec(
            *self._args(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(60):  # a bound on a failure, not a speed check
                line = await self._ready_line(self.proc.stdout)
        except BaseException:  # not ready in time, or the test gave up: leave nothing behind
            self.proc.kill()
            await self.proc.wait()
            raise
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        self.http_url, self.events, self.replay = fields["http"], fields["events"], fields["replay"]
        return self

    @staticmethod
    async def _ready_line(stdout: asyncio.StreamReader) -> str:
        while True:
            line = (await stdout.readline()).decode()
            if not line:
                raise RuntimeError("kvroute-sim exited before it was ready")
            if line.startswith("kvroute-sim ready"):
                return line

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.proc.wait(), 15)

    async def complete(self, tokens: list[int], salt: str | None = None) -> None:
        body: dict[str, Any] = {"model": "m", "prompt": tokens, "max_tokens": 1}
        if salt:
            body["cache_salt"] = salt
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.http_url}/v1/completions", json=body) as response,
        ):
            assert response.status == 200, await response.text()

    async def fault(self, **update: Any) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.http_url}/sim/faults", json=update) as response,
        ):
            assert response.status == 200, await response.text()

    async def cached_hashes(self) -> set[int]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{self.http_url}/sim/state") as response,
        ):
            state = await response.json()
        return {normalize_hash(h) for h in state["cached_block_hashes"]}


@dataclass
class PromptBook:
    """Every prompt sent to a sim, to turn its cached engine hashes into router keys."""

    event_format: str
    block_size: int
    router_block_size: int = 16
    prompts: list[tuple[list[int], str | None]] = field(default_factory=list)

    def add(self, tokens: list[int], salt: str | None = None) -> list[int]:
        self.prompts.append((tokens, salt))
        return tokens

    def router_keys(self, cached: set[int]) -> set[int]:
        """Router keys of the router blocks whose completing engine block is cached.

        Fails if the engine caches a block no prompt explains (the oracle would be blind).
        """
        hasher = make_format(self.event_format, self.block_size).hasher  # type: ignore[arg-type]
        keys: set[int] = set()
        explained: set[int] = set()
        for tokens, salt in self.prompts:
            ids = [
                normalize_hash(hasher.event_id(d))
                for d in prompt_digests(hasher, tokens, self.block_size, salt)
            ]
            explained |= set(ids)
            router = block_keys(
                tokens, model="m", namespace=salt or "", block_size=self.router_block_size
            )
            for i, key in enumerate(router):
                completing = ((i + 1) * self.router_block_size - 1) // self.block_size
                if completing < len(ids) and ids[completing] in cached:
                    keys.add(key)
        assert cached <= explained, "the engine caches blocks no prompt explains"
        return keys
