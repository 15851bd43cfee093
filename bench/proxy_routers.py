"""The routers ``bench.proxy`` puts in front of the same replicas, each on the same CPU budget.

Contenders, all on loopback: ``kvroute round_robin`` (``kvroute-proxy --static-replicas``,
one worker: no control plane to ask), ``kvroute kv_cost`` (one ``kvroute-proxy`` of a
whole local fleet as ``kvroute up --engines`` runs it: NATS, etcd, the control plane and
a sidecar per replica, the ``default`` workload's strategy, ``kv_cost``, or another set
through the admin API (``strategy``); without the debug headers the demo shows, as deploy/
runs a proxy), and the peer routers
``sglang-router``, ``vllm-router`` and ``smg`` with their ``round_robin`` and ``cache_aware``
policies (installed into their own virtual environments by :mod:`bench.e2e.peers`).

Same CPU budget: the benchmark process pins itself (and so everything it starts) to all
CPUs but the first, then pins every thread of each router process, and of its children,
to the first CPU. A router that cannot be installed or started is recorded with the
reason (``not_run``), never left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.e2e.harness import _wait_answering
from bench.e2e.peers import PEERS, PeerUnavailable
from bench.proxy_report import FLEET_STRATEGY
from kvroute.servers import free_port
from kvroute.supervisor import ChildFailed, ChildSpec, Supervisor
from kvroute.up import Fleet, LocalFleet, UpError, UpOptions, ready_field, venv_tool_or_fail

PEER_POLICIES = ("round_robin", "cache_aware")
FLEET_PROXY = "proxy-0"  # the child name LocalFleet gives its first proxy


@dataclass(frozen=True)
class CpuSplit:
    """The CPUs every router gets (the same for each) and the CPUs for everything else."""

    routers: frozenset[int]
    rest: frozenset[int]

    def describe(self) -> str:
        return (
            f"every router pinned to CPU {_cpus(self.routers)}; replicas, control plane, "
            f"sidecars and the load generator on CPU {_cpus(self.rest)}"
        )


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def split_cpus(available: set[int]) -> CpuSplit | None:
    """The first CPU for the routers, the others for the rest; None with fewer than two."""
    if len(available) < 2:
        return None
    first = min(available)
    return CpuSplit(frozenset({first}), frozenset(available - {first}))


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += parents.get(current, [])
    return found


def pin_tree(pid: int, cpus: frozenset[int]) -> int:
    """Pin every thread of ``pid`` and of its descendants to ``cpus``; threads pinned."""
    pinned = 0
    for process in descendants(pid):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{process}/task").iterdir():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task.name), cpus)
                    pinned += 1
    return pinned


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants."""
    total = 0.0
    for process in descendants(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass(frozen=True)
class Router:
    name: str  # "kvroute round_robin", "sglang-router cache_aware", ...
    url: str
    pid: int
    helpers: tuple[int, ...] = ()  # processes that work for it off its CPU (kv_aware's fleet)


class Routers:
    """Starts every contender in front of ``replicas`` and stops them all (``aclose``)."""

    def __init__(
        self,
        replicas: list[str],
        run_dir: Path,
        model: str,
        split: CpuSplit | None,
        strategy: str = FLEET_STRATEGY,
    ) -> None:
        self.replicas = replicas
        self.strategy = strategy  # the fleet's default workload's (``kvroute {strategy}``)
        self.run_dir = run_dir
        self.model = model
        self.split = split
        self.supervisor = Supervisor(run_dir)
        self.fleet: LocalFleet | None = None
        self.running: list[Router] = []
        self.not_run: dict[str, str] = {}  # name -> why
        # kvroute proxy -> its ready line's "compiled=N/M": how much of its request path
        # ran compiled (dataplane/native.py), so a result says which build it measured
        self.compiled: dict[str, str] = {}

    async def start(self, session: aiohttp.ClientSession, peers: tuple[str, ...]) -> None:
        await self._start_static()
        await self._start_fleet()
        for peer in PEERS:
            for policy in PEER_POLICIES:
                if peer in peers:
                    await self._start_peer(peer, policy)
                else:
                    self.not_run[f"{peer} {policy}"] = "left out (--peers)"
        for router in list(self.running):
            await self._until_routing(session, router)

    async def aclose(self) -> None:
        await self.supervisor.stop_all()
        if self.fleet is not None:
            await self.fleet.aclose()

    def _add(self, name: str, url: str, pid: int, helpers: tuple[int, ...] = ()) -> None:
        if self.split is not None:
            pin_tree(pid, self.split.routers)
        self.running.append(Router(name, url, pid, helpers))

    async def _start_static(self) -> None:
        argv = [
            venv_tool_or_fail("kvroute-proxy"), "--port=0", "--workers=1",
            f"--static-replicas={','.join(self.replicas)}", "--static-strategy=round_robin",
            "--log-level=WARNING",
        ]  # fmt: skip
        spec = ChildSpec("kvroute-round_robin", argv, ready_line="kvroute-proxy ready")
        child = await self.supervisor.start(spec)
        url = ready_field(child.ready_text, "http")
        self._add("kvroute round_robin", url, child.proc.pid)
        self.compiled["kvroute round_robin"] = ready_field(child.ready_text, "compiled")

    async def _start_fleet(self) -> None:
        """The default strategy needs the residency map: one proxy of a whole local fleet."""
        options = UpOptions(
            engines=tuple(self.replicas), proxies=1, port=free_port(),
            data_dir=self.run_dir / "kvroute-fleet", debug_headers=False,
        )  # fmt: skip
        self.fleet = LocalFleet(options, say=lambda _: None)
        try:
            fleet = await self.fleet.start()
        except (UpError, ChildFailed) as exc:
            self.not_run[f"kvroute {self.strategy}"] = f"the local fleet did not start: {exc}"
            return
        if self.strategy != FLEET_STRATEGY:
            await self._set_strategy(fleet)
        children = self.fleet.supervisor.children
        child = next(c for c in children if c.name == FLEET_PROXY)
        helpers = tuple(c.proc.pid for c in children if c is not child)
        self._add(f"kvroute {self.strategy}", fleet.proxy_urls[0], child.proc.pid, helpers)
        self.compiled[f"kvroute {self.strategy}"] = ready_field(child.ready_text, "compiled")

    async def _set_strategy(self, fleet: Fleet) -> None:
        """The default workload routes by ``self.strategy`` (the admin API), once its
        proxy has made a decision with it (bounded: 30 s)."""
        headers = {"authorization": f"Bearer {fleet.admin_token}"}
        body = {"strategy": self.strategy}
        request = {"model": self.model, "prompt": "Hello", "max_tokens": 1}
        series = f'kvroute_proxy_decision_seconds_count{{strategy="{self.strategy}"}}'
        async with aiohttp.ClientSession() as session:
            url = f"{fleet.admin_urls[0]}/v1/workloads/default"
            async with session.patch(url, json=body, headers=headers) as r:
                if r.status >= 300:
                    raise SystemExit(f"--fleet-strategy {self.strategy}: {await r.text()}")
            proxy = fleet.proxy_urls[0]
            for _ in range(300):
                async with session.post(f"{proxy}/v1/completions", json=request) as r:
                    await r.read()
                async with session.get(f"{proxy}/metrics") as r:
                    if any(line.startswith(series) and float(line.split()[-1]) > 0
                           for line in (await r.text()).splitlines()):  # fmt: skip
                        return
                await asyncio.sleep(0.1)  # the control plane's stream to the proxy
        raise SystemExit(f"--fleet-strategy {self.strategy}: the proxy never routed by it")

    async def _start_peer(self, name: str, policy: str) -> None:
        peer = PEERS[name]
        try:
            await asyncio.to_thread(peer.ensure_installed)
            port = free_port()
            spec = ChildSpec(
                f"{name}-{policy}",
                peer.argv(port, self.replicas, policy, free_port()),
                env={"HF_HUB_OFFLINE": "1"},
                ready_url=f"http://127.0.0.1:{port}/health",
            )
            child = await self.supervisor.start(spec)
        except (PeerUnavailable, ChildFailed) as exc:
            self.not_run[f"{name} {policy}"] = str(exc).splitlines()[0]
            return
        self._add(f"{name} {policy}", f"http://127.0.0.1:{port}", child.proc.pid)

    async def _until_routing(self, session: aiohttp.ClientSession, router: Router) -> None:
        try:
            await _wait_answering(session, router.url, self.model)
        except PeerUnavailable as exc:
            self.running.remove(router)
            self.not_run[router.name] = str(exc)
