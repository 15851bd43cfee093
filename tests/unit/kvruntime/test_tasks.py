"""A service's background tasks: all stopped by aclose, and a failed one is not lost."""

from __future__ import annotations

import asyncio

import pytest

from kvruntime.tasks import BackgroundTasks


async def test_aclose_stops_every_task_and_waits_for_its_cleanup() -> None:
    tasks = BackgroundTasks()
    started, cleaned = asyncio.Event(), []

    async def loop(name: str) -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            cleaned.append(name)

    tasks.spawn(loop("watch"), name="watch")
    tasks.spawn(loop("report"), name="report")
    await started.wait()
    assert tasks.running
    await tasks.aclose()
    assert sorted(cleaned) == ["report", "watch"]
    assert not tasks.running
    await tasks.aclose()  # closing twice is harmless


async def test_a_task_that_ended_cleanly_is_forgotten() -> None:
    tasks = BackgroundTasks()

    async def short() -> None:
        pass

    await tasks.spawn(short(), name="resync")
    assert not tasks.running


async def test_a_task_that_failed_raises_at_aclose() -> None:
    tasks = BackgroundTasks()
    failed = asyncio.Event()

    async def broken() -> None:
        failed.set()
        raise RuntimeError("watch loop bug")

    tasks.spawn(broken())
    await failed.wait()
    with pytest.raises(RuntimeError, match="watch loop bug"):
        await tasks.aclose()
