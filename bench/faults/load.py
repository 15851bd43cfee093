"""The steady load a fault runs under: chat requests on a few shared system prompts,
streamed (or whole: ``stream=False``), open loop (one every ``1/rate`` s, whatever the
answers take), each request's answer or failure kept in one
:class:`~kvroute.demo.PhaseResult`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp

from kvroute.demo import Answer, PhaseResult, send_one
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
        self,
        session: aiohttp.ClientSession,
        proxy: str,
        rate: float,
        prompts: int,
        stream: bool = True,
    ) -> None:
        self.session, self.proxy, self.rate, self.stream = session, proxy, rate, stream
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
        body = chat(self.systems[index % len(self.systems)], f"Steady question {index}?")
        if not self.stream:
            del body["stream_options"]
            body["stream"] = False
        return body

    async def _pace(self) -> None:
        start = time.perf_counter()
        while True:
            index = self.sent
            self.sent += 1
            send = send_one if self.stream else send_whole
            request = send(self.session, self.proxy, self.body(index), self.result, index)
            self._requests.append(asyncio.create_task(request))
            next_at = start + self.sent / self.rate
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))  # the load's pace


async def send_whole(
    session: aiohttp.ClientSession,
    proxy: str,
    body: dict[str, Any],
    result: PhaseResult,
    index: int,
) -> None:
    """One whole (non-streamed) chat request, kept as :func:`~kvroute.demo.send_one`
    keeps a stream: its time to first token is the whole answer's, by this clock."""
    started = time.perf_counter()
    try:
        async with session.post(f"{proxy}/v1/chat/completions", json=body) as response:
            answer = await response.json() if response.status == 200 else None
            replica = response.headers.get("x-kvroute-replica", "?")
    except (aiohttp.ClientError, TimeoutError, ValueError):
        answer = None
    if not answer or not answer.get("choices"):
        result.errors += 1
        return
    took = time.perf_counter() - started
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    prompt = int(usage.get("prompt_tokens", 0))
    result.answers.append(Answer(index, started, took, prompt, cached, replica, total_s=took))
    result.ttft_s.append(took)
    result.by_replica[replica] = result.by_replica.get(replica, 0) + 1
    result.prompt_tokens += prompt
    result.cached_tokens += cached


def p99(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None
