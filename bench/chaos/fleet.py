"""The chaos benchmark's fleet: ``kvroute up``'s, with the handles a fault needs.

:class:`ChaosFleet` is :class:`~kvroute.up.LocalFleet` (six ``kvroute-sim`` engines with
their sidecars, two control planes with leader election in etcd, two proxies, NATS and
etcd, all on 127.0.0.1) plus:

- the proxies behind one address, the e2e harness's TCP round-robin balancer
  (:class:`~bench.e2e.balancer.RoundRobinBalancer`, the stand-in for a Kubernetes
  Service), where the load goes;
- the last proxy reaching the control planes through a :class:`Link` per instance, which
  a fault can cut (a partition of that proxy alone);
- :meth:`kill` (SIGKILL to a child's process group) and :meth:`restart` (the same
  command line on the ports it had, so every peer finds it where it was).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import replace
from pathlib import Path

import aiohttp

from bench.e2e.balancer import RoundRobinBalancer
from bench.faults.children import child_named, kill_child
from kvroute.servers import free_port
from kvroute.supervisor import Child
from kvroute.up import Fleet, LocalFleet, UpOptions

_CHUNK = 64 * 1024
# what a restarted child must keep: its flag -> the readiness line's field with the value
_PINNED = {
    "--port": "http",
    "--kv-events-endpoint": "events",
    "--replay-endpoint": "replay",
    "--admin-port": "admin",
    "--grpc-port": "grpc",
}


class Link:
    """A TCP relay to one backend that a fault can cut: while cut, connections are
    accepted and held silent (nothing reaches the backend, nothing comes back), as a
    network partition looks to the client; mending it closes what was held, so the
    client's reconnection goes through."""

    def __init__(self) -> None:
        self.port = free_port()
        self.backend: tuple[str, int] | None = None  # set once the backend is known
        self.cut = False
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    def sever(self) -> None:
        """Cut: every relayed connection stops moving bytes (held open, silent)."""
        self.cut = True
        for pipe in list(self._pipes):
            pipe.cancel()

    def mend(self) -> None:
        """Mend: the held connections close; new ones are relayed again."""
        self.cut = False
        for writer in list(self._open):
            writer.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self.sever()
        self.mend()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            if not self.cut and self.backend is not None:
                await self._relay(reader, writer, self.backend)
            await writer.wait_closed()  # cut: held until mended (or the client gives up)
        except (ConnectionError, OSError):
            pass
        finally:
            self._open.discard(writer)
            writer.close()

    async def _relay(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: tuple[str, int]
    ) -> None:
        up_reader, up_writer = await asyncio.open_connection(*backend)
        pipes = {
            asyncio.ensure_future(_copy(reader, up_writer)),
            asyncio.ensure_future(_copy(up_reader, writer)),
        }
        self._pipes |= pipes
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._pipes -= pipes
            up_writer.close()
            if not self.cut:  # one side ended: so does the other
                writer.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()


def chaos_options(run_dir: Path, replicas: int = 6, proxies: int = 2) -> UpOptions:
    """``kvroute up --replicas 6 --proxies 2 --ha`` on free ports."""
    return UpOptions(
        replicas=replicas, proxies=proxies, ha=True, port=free_port(), data_dir=run_dir
    )


class ChaosFleet(LocalFleet):
    """``kvroute up``'s fleet with a balancer in front and a cuttable proxy; see the
    module's docstring."""

    def __init__(self, options: UpOptions) -> None:
        super().__init__(options, say=lambda _line: None)
        self.links = [Link() for _ in range(2 if options.ha else 1)]
        self.balancer: RoundRobinBalancer | None = None

    @property
    def url(self) -> str:
        """Where clients send requests: the balancer in front of the proxies."""
        assert self.balancer is not None, "start() first"
        return self.balancer.url

    @property
    def partitioned_proxy(self) -> str:
        return f"proxy-{self.options.proxies - 1}"

    async def start(self) -> Fleet:
        for link in self.links:
            await link.start()
        fleet = await super().start()
        backends = [("127.0.0.1", self.options.port + i) for i in range(self.options.proxies)]
        self.balancer = await RoundRobinBalancer(backends).start()
        return fleet

    def proxy_argv(self, index: int) -> list[str]:
        argv = super().proxy_argv(index)
        if index != self.options.proxies - 1:
            return argv
        for link, address in zip(self.links, self.fleet.grpc_addresses, strict=True):
            host, port = address.rsplit(":", 1)
            link.backend = (host, int(port))
        where = argv.index("--controlplane") + 1
        argv[where] = ",".join(link.address for link in self.links)
        return argv

    async def aclose(self) -> None:
        if self.balancer is not None:
            await self.balancer.aclose()
        for link in self.links:
            await link.aclose()
        await super().aclose()

    # -- children ------------------------------------------------------------------
    def child(self, name: str) -> Child:
        """The running (latest) child called ``name``."""
        return child_named(self, name)

    def running(self) -> dict[str, int]:
        """Each running child's name -> its process group id."""
        return {c.name: c.proc.pid for c in self.supervisor.children if c.proc.returncode is None}

    async def kill(self, name: str) -> None:
        """SIGKILL to ``name``'s process group, as an expected exit; returns once it died."""
        await kill_child(self.child(name))

    async def restart(self, name: str, extra: dict[str, str] | None = None) -> Child:
        """Start ``name`` again with its command line, on the ports it had (``extra``
        overrides flags); returns once it is ready."""
        old = self.child(name)
        argv = pinned_argv(old.spec.argv, old.ready_text)
        for flag, value in (extra or {}).items():
            argv[argv.index(flag) + 1] = value
        return await self.supervisor.start(replace(old.spec, argv=argv))

    async def leader(self, session: aiohttp.ClientSession) -> str | None:
        """The control plane that leads the shard (its ``kvroute_controlplane_leader``)."""
        for index, admin in enumerate(self.fleet.admin_urls):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{admin}/metrics") as response:
                    text = await response.text()
                if re.search(r"^kvroute_controlplane_leader 1(\.0)?$", text, re.MULTILINE):
                    return f"controlplane-{index}"
        return None


def pinned_argv(argv: list[str], ready_text: str) -> list[str]:
    """``argv`` with each port it asked the kernel for (``0``) replaced by the one it got,
    read from its readiness line."""
    fields = dict(re.findall(r"\b(\w+)=(\S+)", ready_text))
    pinned = list(argv)
    for flag, field_name in _PINNED.items():
        if flag not in pinned or field_name not in fields:
            continue
        where = pinned.index(flag) + 1
        value = fields[field_name]
        if flag.endswith("-port"):
            value = value.rsplit(":", 1)[-1].strip("/")
        pinned[where] = value
    return pinned
