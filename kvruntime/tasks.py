"""The background tasks a service owns: spawned by its ``start()``, every one cancelled
and awaited by its ``aclose()``.

Each long-lived kvroute service runs loops beside its requests (a state watch, a report
period, a probe round, a leader's jobs). Owning them in one place means none outlives
its service, and a loop that failed raises where the service is closed instead of
vanishing with its task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    """Tasks spawned on the running loop and stopped together by :meth:`aclose`."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def running(self) -> bool:
        """Whether anything was spawned since the last :meth:`aclose`."""
        return bool(self._tasks)

    def spawn(self, coroutine: Coroutine[Any, Any, None], *, name: str | None = None) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coroutine, name=name))

    async def aclose(self) -> None:
        """Cancel every task, then wait for each to end (its own error, if any, raises)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
