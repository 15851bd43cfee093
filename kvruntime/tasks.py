"""The background tasks a service owns: spawned by its ``start()``, every one cancelled
and awaited by its ``aclose()``.

Each long-lived kvroute service runs loops beside its requests (a state watch, a report
period, a probe round, a leader's jobs) and short tasks (a resync request). Owning them
in one place means none outlives its service, and a task that failed raises where the
service is closed instead of vanishing with its task; a task that ended cleanly is
forgotten at once, so short ones do not pile up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    """Tasks spawned on the running loop and stopped together by :meth:`aclose`."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> bool:
        """Whether a task spawned since the last :meth:`aclose` runs (or failed)."""
        return bool(self._tasks)

    def spawn(
        self, coroutine: Coroutine[Any, Any, None], *, name: str | None = None
    ) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._forget_if_clean)
        return task

    def _forget_if_clean(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            self._tasks.discard(task)

    async def aclose(self) -> None:
        """Cancel every task, then wait for each to end (its own error, if any, raises)."""
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
