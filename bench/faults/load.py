"""The steady load a fault runs under: streamed chat requests on a few shared system
prompts, open loop (one every ``1/rate`` s, whatever the answers take), each request's
answer or failure kept in one :class:`~kvroute.demo.PhaseResult`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

import aiohttp

from kvroute.demo import PhaseResult, send_one
from kvroute.supervisor import Child
from kvroute.up import SIM_MODEL


def chat(system: str, question: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": SIM_MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def system_prompt(name: str) -> str:
    """A system prompt of about 600 built-in tokens, its own from the first block."""
    return f"{name}: " + " ".join(f"{name}-{word}" for word in range(600))


class SteadyLoad:
    """``async with SteadyLoad(session, proxy, rate, prompts):`` requests go out until
    the block ends, then every one sent is waited for."""

    def __init__(
        self, session: aiohttp.ClientSession, proxy: str, rate: float, prompts: int
    ) -> None:
        self.session, self.proxy, self.rate = session, proxy, rate
        self.systems = [system_prompt(f"shared{i}") for i in range(prompts)]
        self.result = PhaseResult("load")  # every request's answer, or its failure
        self.sent = 0
        self._requests: list[asyncio.Task[None]] = []
        self._pacer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> SteadyLoad:
        self._pacer = asyncio.create_task(self._pace())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._pacer is not None
        self._pacer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pacer
        await asyncio.gather(*self._requests)

    def body(self, index: int) -> dict[str, Any]:
        """The ``index``-th request's body (its prompt, for whoever must know it)."""
        return chat(self.systems[index % len(self.systems)], f"Steady question {index}?")

    async def _pace(self) -> None:
        start = time.perf_counter()
        while True:
            index = self.sent
            self.sent += 1
            request = send_one(self.session, self.proxy, self.body(index), self.result, index)
            self._requests.append(asyncio.create_task(request))
            next_at = start + self.sent / self.rate
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))  # the load's pace


def p99(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None


def signal_child(child: Child, signum: signal.Signals) -> None:
    """``signum`` to a child of ``kvroute up`` (its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, signum)
