"""What a fault does to a child of ``kvroute up``'s fleet (:class:`~kvroute.up.LocalFleet`):
find it by name, signal its process group, kill it, stop it for a while. One way for
``bench.faults`` and ``bench.chaos`` alike; and the fleet a fault of ``bench.faults``
runs on (:func:`local_fleet`)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from kvroute.servers import free_port
from kvroute.supervisor import Child
from kvroute.up import Fleet, LocalFleet, UpOptions

REQUEST_TIMEOUT_S = 120.0


@contextlib.asynccontextmanager
async def local_fleet(
    replicas: int, run_dir: Path
) -> AsyncIterator[tuple[LocalFleet, Fleet, aiohttp.ClientSession]]:
    """``kvroute up``'s fleet of ``replicas`` engines on free ports (its printout
    silenced), and a client session; both closed after the block."""
    options = UpOptions(replicas=replicas, port=free_port(), data_dir=run_dir)
    local = LocalFleet(options, say=lambda _line: None)
    try:
        fleet = await local.start()
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            yield local, fleet, session
    finally:
        await local.aclose()


def child_named(local: LocalFleet, name: str) -> Child:
    """The running (latest) child called ``name`` (``sim-0``, ``nats``, ...)."""
    return [c for c in local.supervisor.children if c.name == name][-1]


def signal_child(child: Child, signum: signal.Signals) -> None:
    """``signum`` to a child of ``kvroute up`` (its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, signum)


async def kill_child(child: Child) -> None:
    """SIGKILL to ``child``'s process group, as an exit the supervisor expects (not a
    failure of the fleet); returns once it died."""
    child.stopping = True
    signal_child(child, signal.SIGKILL)
    await child.proc.wait()


@contextlib.asynccontextmanager
async def stopped(child: Child) -> AsyncIterator[None]:
    """``child`` stopped (SIGSTOP: the kernel still accepts its connections, nothing
    answers) for the block, and resumed (SIGCONT) whatever happens in it: a hung
    engine."""
    signal_child(child, signal.SIGSTOP)
    try:
        yield
    finally:
        signal_child(child, signal.SIGCONT)
