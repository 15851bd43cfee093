"""Child processes for ``kvroute up``: started in order, watched, stopped in reverse.

Each child runs in its own process group (``start_new_session``), so stopping it stops
whatever it started too (a proxy's workers, say). Its combined output goes to a log file
in the run folder and the last lines are kept in memory, so a child that dies can be
reported with what it said. A child is ready when its readiness line appears in its
output or its health URL answers 200 — never after a fixed sleep. Children are stopped
in the reverse of the order they were started (proxies before the control plane before
the sidecars before the engines before NATS and etcd): SIGTERM to the group, then
SIGKILL if it has not exited within its grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import aiohttp

TAIL_LINES = 20
HEALTH_POLL_S = 0.05


class ChildFailed(RuntimeError):
    """A child exited, or did not become ready in time; carries its last log lines."""

    def __init__(self, name: str, why: str, tail: list[str]) -> None:
        lines = "\n".join(f"  | {line}" for line in tail) or "  | (no output)"
        super().__init__(f"{name} {why}; its last log lines:\n{lines}")
        self.name = name


@dataclass(frozen=True)
class ChildSpec:
    """How to start one child and know it is ready."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    ready_line: str | None = None  # a substring of the output line that means ready
    ready_url: str | None = None  # or: ready once GET answers 200
    start_timeout_s: float = 60.0
    stop_grace_s: float = 10.0


@dataclass
class Child:
    spec: ChildSpec
    proc: asyncio.subprocess.Process
    log_path: Path
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ready_text: str = ""  # the readiness line, when ready by line
    stopping: bool = False

    @property
    def name(self) -> str:
        return self.spec.name


def _open_log(path: Path) -> IO[str]:
    return path.open("a", buffering=1, encoding="utf-8", errors="replace")


class Supervisor:
    """Starts children one after the other and stops them all, in reverse, once."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self._pumps: list[asyncio.Task[None]] = []
        self._exited: asyncio.Queue[Child] = asyncio.Queue()

    async def start(self, spec: ChildSpec) -> Child:
        """Start ``spec`` and return once it is ready; raise :class:`ChildFailed` if it
        exits first or misses its deadline (it is then stopped)."""
        proc = await asyncio.create_subprocess_exec(
            *spec.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **spec.env},
            start_new_session=True,
        )
        child = Child(spec, proc, self.log_dir / f"{spec.name}.log")
        self.children.append(child)
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pumps.append(asyncio.create_task(self._pump(child, ready)))
        try:
            await asyncio.wait_for(self._until_ready(child, ready), spec.start_timeout_s)
        except TimeoutError:
            raise ChildFailed(
                spec.name, f"was not ready after {spec.start_timeout_s:.0f} s", list(child.tail)
            ) from None
        return child

    async def _until_ready(self, child: Child, ready: asyncio.Future[str]) -> None:
        if child.spec.ready_line is not None:
            child.ready_text = await ready
            if not child.ready_text:
                raise ChildFailed(child.name, self._exit_text(child), list(child.tail))
        if child.spec.ready_url is not None:
            await self._poll_health(child, child.spec.ready_url)

    async def _poll_health(self, child: Child, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while child.proc.returncode is None:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(HEALTH_POLL_S)  # polling a readiness endpoint
        raise ChildFailed(child.name, self._exit_text(child), list(child.tail))

    async def _pump(self, child: Child, ready: asyncio.Future[str]) -> None:
        """Copy the child's output to its log file and tail; resolve ``ready`` with the
        readiness line ('' if the output ends first); report the exit."""
        assert child.proc.stdout is not None
        needle = child.spec.ready_line
        log = _open_log(child.log_path)
        try:
            async for raw in child.proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                log.write(line + "\n")
                child.tail.append(line)
                if needle is not None and not ready.done() and needle in line:
                    ready.set_result(line)
        finally:
            log.close()
            await child.proc.wait()
            if not ready.done():
                ready.set_result("")
            if not child.stopping:
                self._exited.put_nowait(child)

    @staticmethod
    def _exit_text(child: Child) -> str:
        code = child.proc.returncode
        return "exited" if code is None else f"exited with status {code}"

    async def wait_unexpected_exit(self) -> ChildFailed:
        """Wait until a child exits while it was not being stopped; describe it."""
        child = await self._exited.get()
        return ChildFailed(child.name, self._exit_text(child), list(child.tail))

    async def stop_all(self) -> None:
        """Stop every child, newest first; each gets SIGTERM, then SIGKILL after its grace."""
        for child in reversed(self.children):
            await self._stop(child)
        for pump in self._pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        self.children.clear()
        self._pumps.clear()

    async def _stop(self, child: Child) -> None:
        child.stopping = True
        if child.proc.returncode is not None:
            return
        _signal_group(child.proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(child.proc.wait(), child.spec.stop_grace_s)
        except TimeoutError:
            _signal_group(child.proc.pid, signal.SIGKILL)
            await child.proc.wait()
        # anything the child started in its group and left behind goes too
        _signal_group(child.proc.pid, signal.SIGKILL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
