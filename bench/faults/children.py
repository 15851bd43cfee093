"""What a fault does to a child of ``kvroute up``'s fleet (:class:`~kvroute.up.LocalFleet`):
find it by name, signal its process group, kill it, stop it for a while. One way for
``bench.faults`` and ``bench.chaos`` alike."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator

from kvroute.supervisor import Child
from kvroute.up import LocalFleet


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
