"""``kvroute bench e2e``: real routers in front of one simulated fleet, the same requests each.

One fleet of ``kvroute-sim`` engines (time-scaled, with less KV cache than the workload's
shared prefixes need, so routing decides what stays cached) serves every contender in
turn: kvroute's proxy with each strategy (its control plane, sidecars, NATS and etcd
started by ``kvroute up``'s launcher in ``--engines`` mode), four kvroute proxies behind
a round-robin L4 balancer, and the peer routers (``sglang-router``, ``vllm-router``,
``smg``) with their ``round_robin`` and ``cache_aware`` policies, one instance and four
behind the same balancer (``smg``'s four sharing their state over its mesh). Between
contenders every engine's cache is emptied, so each starts cold.

The many-proxies curve (``E2EConfig.proxies``) runs instead 1, 2, 4, 8... routers of each
kind behind the balancer, on the multi-turn chat workload (:mod:`bench.e2e.chat`) and on
the shared-prefix one, and counts the requests each engine served: one router's view of
the fleet is all a proxy has of its own sends, so what several proxies lose shows here.

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
from bench.e2e.chat import ChatWorkload, run_conversations
from bench.e2e.peers import PEERS, Peer, PeerUnavailable, mesh_argv
from kvroute.demo import AdminClient, DemoWorkload, EngineWatch, PhaseResult, run_phase
from kvroute.servers import free_port
from kvroute.supervisor import ChildSpec, Supervisor
from kvroute.up import SIM_MODEL, LocalFleet, UpOptions, venv_tool_or_fail

RESET_ATTEMPTS = 200
PINNED = "pinned"  # the reference contender's router: no router at all
SHARED = "shared-prefix"  # the workloads a contender can be sent
CHAT = "chat"
MESH_PEER = "smg"  # the peer the curve runs, with and without its mesh
SERVED = "vllm:e2e_request_latency_seconds_count"  # an engine's requests finished


@dataclass(frozen=True)
class Contender:
    router: str  # "kvroute", a peer's name, or PINNED
    policy: str
    instances: int = 1
    mesh: bool = False  # the instances share routing state (a peer's mesh)
    workload: str = SHARED

    @property
    def name(self) -> str:
        if self.router == PINNED:
            return "no router, each group pinned to one engine"
        suffix = f" x{self.instances}" if self.instances > 1 else ""
        return f"{self.router} {self.policy}{suffix}{' mesh' if self.mesh else ''}"


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
    peers: tuple[str, ...] = ("sglang-router", "vllm-router", "smg")
    peer_policies: tuple[str, ...] = ("round_robin", "cache_aware")
    pinned_reference: bool = True  # the floor: groups sent straight to engines, no router
    proxies: tuple[int, ...] = ()  # the many-proxies curve's router counts, instead
    curve_policies: tuple[str, ...] = ("kv_aware", "kv_cost")
    chat: ChatWorkload = field(default_factory=ChatWorkload)

    def contenders(self) -> list[Contender]:
        if self.proxies:
            return self.curve()
        chosen = [Contender(PINNED, "groups")] if self.pinned_reference else []
        chosen += [Contender("kvroute", p) for p in self.kvroute_policies]
        if "kv_aware" in self.kvroute_policies and self.scaled_instances > 1:
            chosen.append(Contender("kvroute", "kv_aware", self.scaled_instances))
        for peer in self.peers:
            chosen += [Contender(peer, p) for p in self.peer_policies]
            if self.scaled_instances > 1 and peer == "sglang-router":
                chosen.append(Contender(peer, "cache_aware", self.scaled_instances))
            if self.scaled_instances > 1 and PEERS[peer].has_mesh:
                chosen.append(Contender(peer, "cache_aware", self.scaled_instances, mesh=True))
        return chosen

    def curve(self) -> list[Contender]:
        """Each router count of the curve: kvroute's proxies, smg with and without its mesh."""
        chosen = []
        for workload in (CHAT, SHARED):
            for n in self.proxies:
                chosen += [
                    Contender("kvroute", p, n, workload=workload) for p in self.curve_policies
                ]
                if MESH_PEER not in self.peers:
                    continue
                chosen.append(Contender(MESH_PEER, "cache_aware", n, n > 1, workload))
                if n > 1:
                    chosen.append(Contender(MESH_PEER, "cache_aware", n, workload=workload))
        return chosen

    def kvroute_proxies(self) -> int:
        """How many proxies the kvroute fleet needs (0: no kvroute contender)."""
        return max((c.instances for c in self.contenders() if c.router == "kvroute"), default=0)

    def expected_requests(self, contender: Contender) -> int:
        if contender.workload == CHAT:
            return self.chat.request_count()
        return len(self.workload.request_groups())

    def request_groups(self, contender: Contender) -> list[int]:
        """Each request's group: its shared prefix's (or its conversation's)."""
        if contender.workload == CHAT:
            return self.chat.request_groups()
        return self.workload.request_groups()


@dataclass
class ContenderResult:
    contender: Contender
    phase: PhaseResult | None = None
    unavailable: str = ""  # why the contender could not run
    served: list[int] = field(default_factory=list)  # requests each engine finished

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
        proxies = self.config.kvroute_proxies()
        if proxies:
            proxies = max(proxies, self.config.scaled_instances)
            options = UpOptions(
                engines=tuple(self.engines),
                proxies=proxies,
                port=_free_port_run(proxies),
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
                before = await _served(session, self.engines)
                phase = await self._measure(session, watch, url, contender)
                served = await _served_since(session, self.engines, before, len(phase.ttft_s))
                return ContenderResult(contender, phase, served=served)
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
        result = PhaseResult(contender.name)
        baseline = dict(await watch.scrape())
        label = f"{contender.name} ({contender.workload})"
        progress = Progress(
            TextColumn(f"{label:>40}"), BarColumn(), MofNCompleteColumn(),
            console=self.console,
        )  # fmt: skip
        task = progress.add_task(label, total=self.config.expected_requests(contender))
        started = time.perf_counter()
        with progress:
            if contender.workload == CHAT:
                assert isinstance(url, str)
                await run_conversations(
                    session, url, self.config.chat, SIM_MODEL, result,
                    lambda: progress.advance(task),
                )  # fmt: skip
            else:
                await run_phase(
                    session, url, self.config.workload.requests(SIM_MODEL), result,
                    self.config.workload.concurrency, lambda: progress.advance(task),
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
        mesh = [free_port() for _ in range(contender.instances)] if contender.mesh else []
        try:
            urls = [
                await self._start_peer(supervisor, peer, contender, i, mesh)
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
        self,
        supervisor: Supervisor,
        peer: Peer,
        contender: Contender,
        index: int,
        mesh: list[int],
    ) -> str:
        """One instance; with ``mesh`` (every instance's mesh port) joined to the others."""
        port = free_port()
        argv = peer.argv(port, self.engines, contender.policy, free_port())
        name = f"{peer.name}-{contender.policy}-{index}"
        if mesh:
            argv += mesh_argv(name, mesh[index], mesh[:index] + mesh[index + 1 :])
        spec = ChildSpec(
            name,
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


async def _served(session: aiohttp.ClientSession, engines: list[str]) -> list[int]:
    """The requests each engine has finished, by its own counter (the replicas' shares)."""
    counts = []
    for engine in engines:
        async with session.get(f"{engine}/metrics") as response:
            text = await response.text()
        found = (line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(SERVED))
        counts.append(round(sum(float(value) for value in found)))
    return counts


async def _served_since(
    session: aiohttp.ClientSession, engines: list[str], before: list[int], answered: int
) -> list[int]:
    """The requests each engine finished since ``before``, once they add up to the
    ``answered`` ones (an engine counts a request a moment after its last byte is sent)."""
    deadline = time.monotonic() + 10
    while True:
        after = await _served(session, engines)
        served = [a - b for a, b in zip(after, before, strict=True)]
        if sum(served) >= answered or time.monotonic() > deadline:
            return served
        await asyncio.sleep(0.05)  # the engines are recording their last requests


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
