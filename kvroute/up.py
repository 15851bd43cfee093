"""``kvroute up``: a whole kvroute fleet on this machine, from embedded defaults.

What runs, all on 127.0.0.1, each a child process in its own process group (see
``supervisor.py``), started in dependency order and stopped in the reverse one:

    nats-server, etcd                        from the installed wheels
    kvroute-sim x N  (or --engines URLs)     the engines
    kvroute-controlplane x 1 (2 with --ha)   on SQLite in the run folder
    kvroute-sidecar x N                      one beside each engine
    kvroute-proxy x M                        on --port, --port+1, ...

Every child is waited for until ready (its readiness line or health URL), never for a
fixed time. Ctrl-C, SIGTERM or SIGHUP stops everything and exits 0, even once the reader
of its output has gone; a child that dies is
reported with its last log lines and ``up`` exits 1; a problem found before anything
starts (a port in use, a missing binary, an engine that does not answer) is one line on
stderr and exit status 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from kvroute.servers import ServerStartError, etcd_command, free_port, nats_command, venv_tool
from kvroute.supervisor import ChildFailed, ChildSpec, Supervisor

SIM_MODEL = "kvroute/sim-model"
POOL = "default"


class UpError(RuntimeError):
    """Something to fix before the fleet can start: one line, exit status 2."""


@dataclass(frozen=True)
class UpOptions:
    replicas: int = 4
    proxies: int = 1
    ha: bool = False
    event_format: str = "vllm"
    time_scale: float = 1.0
    tokenizer: str = "builtin"
    port: int = 8000
    data_dir: Path | None = None
    engines: tuple[str, ...] = ()
    engine_kind: str = "vllm"
    num_blocks: int = 8192
    demo: bool = False
    demo_only: bool = False
    debug_headers: bool = True  # x-kvroute-* on every answer (the demo shows them)
    pd: tuple[int, int] | None = None  # P prefill and D decode sims instead of ``replicas``

    def role(self, index: int) -> str | None:
        """The P/D role of engine ``index`` (``--pd``: the first P prefill), or None."""
        if self.pd is None:
            return None
        return "prefill" if index < self.pd[0] else "decode"


@dataclass
class Fleet:
    """What is running, for the printout, the demo and the tests."""

    run_dir: Path
    admin_token: str
    nats_url: str = ""
    etcd_endpoint: str = ""
    engines: list[str] = field(default_factory=list)  # base URLs
    models: list[str] = field(default_factory=list)  # per engine
    admin_urls: list[str] = field(default_factory=list)
    grpc_addresses: list[str] = field(default_factory=list)
    proxy_urls: list[str] = field(default_factory=list)


def ready_field(line: str, name: str) -> str:
    """The value of ``name=`` in a readiness line (ChildFailed when it has none)."""
    match = re.search(rf"\b{name}=(\S+)", line)
    if match is None:
        raise ChildFailed("launcher", f"readiness line has no {name}=: {line!r}", [])
    return match.group(1)


def venv_tool_or_fail(name: str) -> str:
    found = venv_tool(name)
    if found is None:
        raise UpError(f"{name} not found: run scripts/bootstrap (it installs kvroute into .venv)")
    return found


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise UpError(
                f"port {port} on 127.0.0.1 is in use: stop what listens there or pick "
                "another with --port"
            ) from None


async def engine_model(session: aiohttp.ClientSession, url: str) -> str:
    """The model an already running engine serves (its /v1/models), or :class:`UpError`."""
    try:
        async with session.get(f"{url.rstrip('/')}/v1/models") as response:
            body = await response.json(content_type=None)
            if response.status != 200:
                raise UpError(f"engine {url} answered /v1/models with {response.status}")
            return str(body["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise UpError(
            f"engine {url} does not answer ({exc.__class__.__name__}): start it first, "
            "or check the URL given to --engines"
        ) from None
    except (KeyError, IndexError, TypeError, ValueError):
        raise UpError(f"engine {url} lists no model on /v1/models") from None


class LocalFleet:
    """Starts and stops one local fleet; ``async with`` runs it."""

    def __init__(self, options: UpOptions, *, say: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.say = say or tell
        self._own_dir = options.data_dir is None
        run_dir = options.data_dir or Path(tempfile.mkdtemp(prefix="kvroute-up-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(exist_ok=True)
        self.fleet = Fleet(run_dir=run_dir, admin_token=self._admin_token(run_dir))
        self.supervisor = Supervisor(run_dir / "logs")
        self._sim_lines: list[str] = []  # each simulator's readiness line

    def _admin_token(self, run_dir: Path) -> str:
        """A fresh token per run; kept in the data folder when state is kept."""
        path = run_dir / "admin-token"
        if not self._own_dir and path.exists():
            return path.read_text().strip()
        token = "kvr-admin-" + secrets.token_urlsafe(24)
        path.write_text(token + "\n")
        path.chmod(0o600)
        return token

    def preflight(self) -> None:
        """What can be checked before starting anything."""
        for tool in ("kvroute-sim", "kvroute-sidecar", "kvroute-controlplane", "kvroute-proxy"):
            venv_tool_or_fail(tool)
        for port in self._proxy_ports():
            check_port_free(port)

    def _proxy_ports(self) -> range:
        """The proxies' ports (``--port`` on): no other process of the fleet is given one."""
        return range(self.options.port, self.options.port + self.options.proxies)

    async def start(self) -> Fleet:
        self.preflight()
        try:
            await self._start_infrastructure()
            await self._start_engines()
            await self._start_control_planes()
            await self._start_sidecars()
            await self._start_proxies()
        except ServerStartError as exc:
            raise UpError(str(exc)) from None
        return self.fleet

    async def _start_infrastructure(self) -> None:
        avoid = self._proxy_ports()
        nats_port, etcd_port, peer_port = free_port(avoid), free_port(avoid), free_port(avoid)
        nats = ChildSpec("nats", nats_command(nats_port), ready_line="Server is ready")
        data = self.fleet.run_dir / "etcd"
        etcd = ChildSpec(
            "etcd",
            etcd_command(etcd_port, peer_port, data),
            ready_line="ready to serve client requests",
        )
        await self.supervisor.start(nats)
        await self.supervisor.start(etcd)
        self.fleet.nats_url = f"nats://127.0.0.1:{nats_port}"
        self.fleet.etcd_endpoint = f"127.0.0.1:{etcd_port}"
        self.say(f"  nats        {self.fleet.nats_url}")
        self.say(f"  etcd        {self.fleet.etcd_endpoint}")

    async def _start_engines(self) -> None:
        if self.options.engines:
            timeout = aiohttp.ClientTimeout(total=5)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for url in self.options.engines:
                    self.fleet.models.append(await engine_model(session, url))
                    self.fleet.engines.append(url.rstrip("/"))
        for index in range(0 if self.options.engines else self.options.replicas):
            child = await self.supervisor.start(self._sim_spec(index))
            self.fleet.engines.append(ready_field(child.ready_text, "http"))
            self.fleet.models.append(SIM_MODEL)
            self._sim_lines.append(child.ready_text)
        self.say(f"  engines     {', '.join(self.fleet.engines)}")
        if self.options.pd is not None:
            prefill = self.options.pd[0]
            self.say(f"  P/D         prefill {', '.join(self.fleet.engines[:prefill])}")
            self.say(f"              decode  {', '.join(self.fleet.engines[prefill:])}")
        if not self.options.engines:
            self.say(f"  model       {SIM_MODEL}  tokenizer {self.options.tokenizer}")

    def _sim_spec(self, index: int) -> ChildSpec:
        argv = [
            venv_tool_or_fail("kvroute-sim"),
            "--port", "0",
            "--kv-events-endpoint", "tcp://127.0.0.1:0",
            "--replay-endpoint", "tcp://127.0.0.1:0",
            "--model", SIM_MODEL,
            "--event-format", self.options.event_format,
            "--tokenizer", self.options.tokenizer,
            "--time-scale", str(self.options.time_scale),
            "--num-blocks", str(self.options.num_blocks),
        ]  # fmt: skip
        role = self.options.role(index)
        if role is not None and self.options.event_format == "sglang":
            argv += ["--disaggregation-mode", role]  # its sidecar reads it from the engine
        return ChildSpec(f"sim-{index}", argv, ready_line="kvroute-sim ready")

    def _common_env(self) -> dict[str, str]:
        return {"KVROUTE_ADMIN_TOKEN": self.fleet.admin_token}

    def controlplane_argv(self, index: int) -> list[str]:
        """The command line of the fleet's ``index``-th control plane."""
        return [
            venv_tool_or_fail("kvroute-controlplane"),
            "--nats-url", self.fleet.nats_url,
            "--etcd-endpoints", self.fleet.etcd_endpoint,
            "--database-url", f"sqlite+aiosqlite:///{self.fleet.run_dir / 'kvroute.db'}",
            "--admin-port", "0",
            "--grpc-port", "0",
            "--instance-id", f"cp-{index}",
        ]  # fmt: skip

    async def _start_control_planes(self) -> None:
        for index in range(2 if self.options.ha else 1):
            spec = ChildSpec(
                f"controlplane-{index}",
                self.controlplane_argv(index),
                env=self._common_env(),
                ready_line="kvroute-controlplane ready",
            )
            child = await self.supervisor.start(spec)
            self.fleet.admin_urls.append(ready_field(child.ready_text, "admin"))
            self.fleet.grpc_addresses.append(ready_field(child.ready_text, "grpc"))
        self.say(f"  admin API   {', '.join(self.fleet.admin_urls)}")

    async def _start_sidecars(self) -> None:
        sims = list(self._sim_lines)
        for index, url in enumerate(self.fleet.engines):
            port = free_port(self._proxy_ports())
            argv = [
                venv_tool_or_fail("kvroute-sidecar"),
                "--engine-url", url,
                "--engine-kind", "sglang" if self._is_sglang() else "vllm",
                "--nats-url", self.fleet.nats_url,
                "--replica-id", f"r{index}",
                "--pool", POOL,
                "--model", self.fleet.models[index],
                "--port", str(port),
            ]  # fmt: skip
            role = self.options.role(index)
            if role is not None:
                argv += ["--role", role]
            if sims:
                argv += ["--kv-events-endpoint", ready_field(sims[index], "events")]
                argv += ["--replay-endpoint", ready_field(sims[index], "replay")]
            spec = ChildSpec(f"sidecar-{index}", argv, ready_url=f"http://127.0.0.1:{port}/healthz")
            await self.supervisor.start(spec)

    def _is_sglang(self) -> bool:
        if self.options.engines:
            return self.options.engine_kind == "sglang"
        return self.options.event_format == "sglang"

    def proxy_argv(self, index: int) -> list[str]:
        """The command line of the fleet's ``index``-th proxy."""
        argv = [
            venv_tool_or_fail("kvroute-proxy"),
            "--port", str(self.options.port + index),
            "--proxy-index", str(index),  # behind one balancer: turns spread (kv_cost)
            "--controlplane", ",".join(self.fleet.grpc_addresses),
            "--tokenizer", self.options.tokenizer,
            "--no-auth",  # local use: open, on 127.0.0.1 only (usage_text says so)
        ]  # fmt: skip
        if self.options.debug_headers:
            argv.append("--debug-headers")
        return argv

    async def _start_proxies(self) -> None:
        for index in range(self.options.proxies):
            argv = self.proxy_argv(index)
            port = self.options.port + index
            spec = ChildSpec(
                f"proxy-{index}",
                argv,
                ready_line="kvroute-proxy ready",
                ready_url=f"http://127.0.0.1:{port}/readyz",  # routable replicas known
            )
            child = await self.supervisor.start(spec)
            self.fleet.proxy_urls.append(ready_field(child.ready_text, "http"))
        self.say(f"  proxies     {', '.join(self.fleet.proxy_urls)}")

    async def aclose(self) -> None:
        await self.supervisor.stop_all()
        if self._own_dir:
            shutil.rmtree(self.fleet.run_dir, ignore_errors=True)

    async def __aenter__(self) -> Fleet:
        try:
            return await self.start()
        except BaseException:
            await self.aclose()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def usage_text(fleet: Fleet) -> str:
    """What to paste to use the fleet."""
    proxy = fleet.proxy_urls[0] if fleet.proxy_urls else "http://127.0.0.1:8000"
    admin = fleet.admin_urls[0] if fleet.admin_urls else ""
    model = fleet.models[0] if fleet.models else SIM_MODEL
    python = shlex.quote(sys.executable)  # a bare `python` may lack openai
    return f"""
kvroute is up. Admin token: {fleet.admin_token}  (run folder {fleet.run_dir})
For local use: every part listens on 127.0.0.1 only and the proxies take requests
without a key. deploy/kubernetes's production overlay requires one (kvroute-proxy --auth).

Send a request through the proxy:
  curl -s {proxy}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}]}}'

With the official openai client (this environment's Python has it):
  {python} -c "import openai; c = openai.OpenAI(base_url='{proxy}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', \\
messages=[{{'role': 'user', 'content': 'Hello'}}]).choices[0].message.content)"

Change the default workload's locality weight (the admin API):
  curl -s -X PATCH {admin}/v1/workloads/default -H 'authorization: Bearer {fleet.admin_token}' \\
    -H 'content-type: application/json' -d '{{"locality_weight": 0.9}}'

See how a proxy would route a prompt, and why:
  KVROUTE_ADMIN_TOKEN={fleet.admin_token} kvroute explain --admin-url {admin} \
    --model {model} 'Hello'

Ctrl-C stops everything.
"""


Demo = Callable[[Fleet], Awaitable[None]]
# SIGHUP: the terminal closed. Its default would end this process alone, and the
# children, each in a process group of its own, would run on with nobody to stop them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def tell(text: str, stream: TextIO | None = None) -> None:
    """Print ``text`` for whoever ran ``kvroute up``. A reader that has gone (a closed
    pipe, a hung-up terminal) must not stop the fleet from stopping: the write's error
    would leave every child running, so the stream goes to /dev/null from then on."""
    stream = stream or sys.stdout
    try:
        print(text, file=stream, flush=True)
    except OSError:  # BrokenPipeError, or EIO from a terminal that hung up
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())  # the unflushed rest goes there at exit
            os.close(devnull)


async def run(options: UpOptions, demo: Demo | None = None) -> int:
    """Start the fleet, print how to use it, run ``demo`` if given, then serve until
    SIGINT/SIGTERM/SIGHUP (exit 0), or until a child dies (exit 1). ``demo_only`` exits after
    the demo."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    local = LocalFleet(options)
    stopper = asyncio.ensure_future(stop.wait())
    tasks: list[asyncio.Future[Any]] = [stopper]
    try:
        tell("kvroute up: starting a local fleet")
        starting = asyncio.ensure_future(local.start())
        tasks.append(starting)
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            return 0
        fleet = starting.result()
        tell(usage_text(fleet))
        death = asyncio.ensure_future(local.supervisor.wait_unexpected_exit())
        tasks.append(death)
        showing = asyncio.ensure_future(demo(fleet)) if demo is not None else None
        if showing is not None:
            tasks.append(showing)
        return await _serve(death, stopper, showing, options.demo_only)
    except UpError as exc:
        tell(f"kvroute up: {exc}", sys.stderr)
        return 2
    except ChildFailed as exc:
        tell(f"kvroute up: {exc}", sys.stderr)
        return 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tell("kvroute up: stopping")
        await local.aclose()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def _serve(
    death: asyncio.Future[ChildFailed],
    stopper: asyncio.Future[Any],
    showing: asyncio.Future[None] | None,
    demo_only: bool,
) -> int:
    while True:
        waits = {death, stopper} | ({showing} if showing is not None else set())
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if death in done:
            tell(f"kvroute up: {death.result()}", sys.stderr)
            return 1
        if stopper in done:
            return 0
        if showing is not None and showing in done:
            failure = showing.exception()
            if failure is not None:
                tell(f"kvroute up: the demo failed: {failure}", sys.stderr)
                return 1
            if demo_only:
                return 0
            showing = None
            tell("kvroute up: the fleet keeps serving; Ctrl-C stops it")
