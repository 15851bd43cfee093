"""``kvroute bench e2e``: real routers in front of one simulated fleet, the same requests each.

One fleet of ``kvroute-sim`` engines (time-scaled, with less KV cache than the workload's
shared prefixes need, so routing decides what stays cached) serves every contender in
turn: kvroute's proxy with each strategy (its control plane, sidecars, NATS and etcd
started by ``kvroute up``'s launcher in ``--engines`` mode), four kvroute proxies behind
a round-robin L4 balancer, and the peer routers (``sglang-router``, ``vllm-router``) with
their ``round_robin`` and ``cache_aware`` policies, one instance and four behind the same
balancer. Between contenders every engine's cache is emptied, so each starts cold.

What is measured is measured outside the routers: the engines' own prefix-cache counters
(hit rate), the ``cached_tokens`` each response reports, and this client's clock (TTFT,
throughput); a request that fails or never answers counts as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from bench.e2e.balancer import RoundRobinBalancer
from bench.e2e.peers import PEERS, Peer, PeerUnavailable
from kvroute.demo import AdminClient, DemoWorkload, EngineWatch, PhaseResult, run_phase
from kvroute.servers import free_port
from kvroute.supervisor import ChildSpec, Supervisor
from kvroute.up import SIM_MODEL, LocalFleet, UpOptions, venv_tool_or_fail

RESET_ATTEMPTS = 200
PINNED = "pinned"  # the reference contender's router: no router at all


@dataclass(frozen=True)
class Contender:
    router: str  # "kvroute", a peer's name, or PINNED
    policy: str
    instances: int = 1

    @property
    def name(self) -> str:
        if self.router == PINNED:
            return "no router, each group pinned to one engine"
        suffix = f" x{self.instances}" if self.instances > 1 else ""
        return f"{self.router} {self.policy}{suffix}"


@dataclass(frozen=True)
class E2EConfig:
    replicas: int = 4
    num_blocks: int = 768
    time_scale: float = 1.0
    workload: DemoWorkload = field(default_factory=DemoWorkload)
    scaled_instances: int = 4
    kvroute_policies: tuple[str, ...] = (
        "round_robin", "least_load", "prefix_hash", "kv_aware", "kv_cost",
    )  # fmt: skip
    peers: tuple[str, ...] = ("sglang-router", "vllm-router")
    peer_policies: tuple[str, ...] = ("round_robin", "cache_aware")
    pinned_reference: bool = True  # the floor: groups sent straight to engines, no router

    def contenders(self) -> list[Contender]:
        chosen = [Contender(PINNED, "groups")] if self.pinned_reference else []
        chosen += [Contender("kvroute", p) for p in self.kvroute_policies]
        if "kv_aware" in self.kvroute_policies and self.scaled_instances > 1:
            chosen.append(Contender("kvroute", "kv_aware", self.scaled_instances))
        for peer in self.peers:
            chosen += [Contender(peer, p) for p in self.peer_policies]
            if peer == "sglang-router" and self.scaled_instances > 1:
                chosen.append(Contender(peer, "cache_aware", self.scaled_instances))
        return chosen


@dataclass
class ContenderResult:
    contender: Contender
    phase: PhaseResult | None = None
    unavailable: str = ""  # why the contender could not run

    @property
    def name(self) -> str:
        return self.contender.name


class E2EBench:
    """Owns the engines, the kvroute fleet and one contender's router at a time."""

    def __init__(self, config: E2EConfig, run_dir: Path, console: Console) -> None:
        self.config = config
        self.run_dir = run_dir
        self.console = console
        self.supervisor = Supervisor(run_dir)
        self.engines: list[str] = []
        self.fleet: LocalFleet | None = None

    async def start(self) -> None:
        for index in range(self.config.replicas):
            argv = [
                venv_tool_or_fail("kvroute-sim"),
                "--port", "0",
                "--kv-events-endpoint", "tcp://127.0.0.1:0",
                "--replay-endpoint", "tcp://127.0.0.1:0",
                "--num-blocks", str(self.config.num_blocks),
                "--time-scale", str(self.config.time_scale),
            ]  # fmt: skip
            child = await self.supervisor.start(
                ChildSpec(f"sim-{index}", argv, ready_line="kvroute-sim ready")
            )
            self.engines.append(child.ready_text.split("http=")[1].split()[0])
        if any(c.router == "kvroute" for c in self.config.contenders()):
            options = UpOptions(
                engines=tuple(self.engines),
                proxies=self.config.scaled_instances,
                port=_free_port_run(self.config.scaled_instances),
                data_dir=self.run_dir / "kvroute",
            )
            self.fleet = LocalFleet(options, say=lambda _: None)
            await self.fleet.start()

    async def aclose(self) -> None:
        if self.fleet is not None:
            await self.fleet.aclose()
        await self.supervisor.stop_all()

    async def run(self) -> list[ContenderResult]:
        results = []
        timeout = aiohttp.ClientTimeout(total=300)
        connector = aiohttp.TCPConnector(limit=self.config.workload.concurrency * 2)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            watch = EngineWatch(session, self.engines)
            for contender in self.config.contenders():
                results.append(await self._contend(session, watch, contender))
        return results

    async def _contend(
        self, session: aiohttp.ClientSession, watch: EngineWatch, contender: Contender
    ) -> ContenderResult:
        try:
            async with self._router(session, contender) as url:
                if isinstance(url, str):
                    await _wait_answering(session, url, SIM_MODEL)
                await _reset_when_idle(session, self.engines)
                return ContenderResult(
                    contender, await self._measure(session, watch, url, contender)
                )
        except PeerUnavailable as exc:
            self.console.print(f"[yellow]{contender.name}: not run: {exc}")
            return ContenderResult(contender, unavailable=str(exc))

    async def _measure(
        self,
        session: aiohttp.ClientSession,
        watch: EngineWatch,
        url: str | Callable[[int], str],
        contender: Contender,
    ) -> PhaseResult:
        bodies = self.config.workload.requests(SIM_MODEL)
        result = PhaseResult(contender.name)
        baseline = dict(await watch.scrape())
        progress = Progress(
            TextColumn(f"{contender.name:>28}"), BarColumn(), MofNCompleteColumn(),
            console=self.console,
        )  # fmt: skip
        task = progress.add_task(contender.name, total=len(bodies))
        started = time.perf_counter()
        with progress:
            await run_phase(
                session, url, bodies, result, self.config.workload.concurrency,
                lambda: progress.advance(task),
            )  # fmt: skip
        result.wall_s = time.perf_counter() - started
        if contender.router == PINNED:
            self._label_pinned(result)
        final = await watch.scrape()
        for engine in self.engines:
            result.engine_queries += final[engine].prefix_cache_queries
            result.engine_queries -= baseline[engine].prefix_cache_queries
            result.engine_hits += (
                final[engine].prefix_cache_hits - baseline[engine].prefix_cache_hits
            )
        return result

    @contextlib.asynccontextmanager
    async def _router(
        self, session: aiohttp.ClientSession, contender: Contender
    ) -> AsyncIterator[str | Callable[[int], str]]:
        """The URL requests go to, or for the pinned reference each request's engine."""
        if contender.router == PINNED:
            yield self._pinned()
            return
        if contender.router == "kvroute":
            assert self.fleet is not None
            fleet = self.fleet.fleet
            await AdminClient(session, fleet.admin_urls[0], fleet.admin_token).set_strategy(
                contender.policy
            )
            async with _behind_balancer(fleet.proxy_urls[: contender.instances]) as url:
                yield url
            return
        peer = PEERS[contender.router]
        await asyncio.to_thread(peer.ensure_installed)
        supervisor = Supervisor(self.run_dir)
        try:
            urls = [
                await self._start_peer(supervisor, peer, contender, i)
                for i in range(contender.instances)
            ]
            async with _behind_balancer(urls) as url:
                yield url
        finally:
            await supervisor.stop_all()

    def _pinned(self) -> Callable[[int], str]:
        """Each request's engine: group ``g`` on engine ``g mod replicas``, the placement
        an oracle router would choose for equal groups, with no router in the way."""
        groups = self.config.workload.request_groups()
        return lambda index: self.engines[groups[index] % len(self.engines)]

    def _label_pinned(self, result: PhaseResult) -> None:
        """Name the engine each pinned request went to (no router's header says it)."""
        groups, count = self.config.workload.request_groups(), len(self.engines)
        result.answers = [replace(a, replica=f"r{groups[a.index] % count}") for a in result.answers]
        result.by_replica = dict(Counter(a.replica for a in result.answers))

    async def _start_peer(
        self, supervisor: Supervisor, peer: Peer, contender: Contender, index: int
    ) -> str:
        port = free_port()
        argv = peer.argv(port, self.engines, contender.policy, free_port())
        spec = ChildSpec(
            f"{peer.name}-{contender.policy}-{index}",
            argv,
            env={"HF_HUB_OFFLINE": "1"},
            ready_url=f"http://127.0.0.1:{port}/health",
        )
        await supervisor.start(spec)
        return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _behind_balancer(urls: list[str]) -> AsyncIterator[str]:
    """One URL as it is; several behind a round-robin L4 balancer."""
    if len(urls) == 1:
        yield urls[0]
        return
    backends = [("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in urls]
    balancer = await RoundRobinBalancer(backends).start()
    try:
        yield balancer.url
    finally:
        await balancer.aclose()


async def _wait_answering(session: aiohttp.ClientSession, url: str, model: str) -> None:
    """Until the router answers a tiny completion (it may list workers before routing)."""
    body = {"model": model, "prompt": "ping", "max_tokens": 1}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.post(f"{url}/v1/completions", json=body) as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.1)  # polling a router until it routes
    raise PeerUnavailable(f"{url} did not answer a completion within 60 s")


async def _reset_when_idle(session: aiohttp.ClientSession, engines: list[str]) -> None:
    """Empty every engine's prefix cache; an engine answers 409 while blocks are in use."""
    for engine in engines:
        for _ in range(RESET_ATTEMPTS):
            async with session.post(f"{engine}/reset_prefix_cache") as response:
                if response.status < 300:
                    break
            await asyncio.sleep(0.05)  # the engine is finishing a request
        else:
            raise RuntimeError(f"{engine} kept its cache in use; cannot start cold")


def _free_port_run(count: int) -> int:
    """A first port such that ``count`` consecutive ports are free now."""
    for _ in range(100):
        first = free_port()
        if first + count > 65535:
            continue
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no run of {count} free ports")
