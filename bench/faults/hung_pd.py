"""A hung engine of a disaggregated prefill/decode fleet under steady load: one prefill,
or one decode ``kvroute-sim`` stopped (SIGSTOP) and resumed (SIGCONT).

On ``kvroute up --pd P:D``'s fleet (vLLM's or SGLang's protocol), the steady load of
:mod:`bench.faults.load` runs before, through and after the stop, streamed or whole.
Measured from outside as for a colocated fleet (:mod:`bench.faults.hung_engine`):
failed out of sent; the requests started 2 s or more after the stop that took over 3 s;
TTFT p99 while stopped. An answer names only its decode replica, so "back" here is how
long after SIGCONT the proxy held no replica out (its ``/readyz`` ``circuit_open``
empty: the stopped one's probe answered).

Targets (issue 46): 0 failed; none over 3 s among those started 2 s or more after the
stop; routable again within 2 s of SIGCONT.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.faults.children import REQUEST_TIMEOUT_S, child_named
from bench.faults.hung_engine import HungConfig, HungResult, stopped_under_load
from kvroute.servers import free_port
from kvroute.up import LocalFleet, UpOptions

ROLES = ("prefill", "decode")
READY_S = 30.0  # the fleet's roles known to the proxy within this
POLL_S = 0.05


@dataclass(frozen=True)
class PdHungConfig(HungConfig):
    """:class:`HungConfig`'s fault on a P/D fleet (its ``replicas`` unused)."""

    half: str = "prefill"  # the role of the engine stopped
    protocol: str = "vllm"  # or "sglang"
    prefill: int = 2
    decode: int = 2


@dataclass
class PdHungResult(HungResult):
    """:class:`HungResult`, its ``back_s`` SIGCONT to no replica held out by the proxy."""

    half: str
    protocol: str


async def run_hung_pd(config: PdHungConfig, run_dir: Path) -> PdHungResult:
    pd = (config.prefill, config.decode)
    options = UpOptions(
        replicas=sum(pd), pd=pd, event_format=config.protocol, port=free_port(), data_dir=run_dir
    )
    local = LocalFleet(options, say=lambda _line: None)
    victim_index = 0 if config.half == "prefill" else config.prefill  # kvroute up's order
    try:
        fleet = await local.start()
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            proxy = fleet.proxy_urls[0]
            roles = dict(zip(ROLES, pd, strict=True))
            if await _until(session, proxy, lambda r: r.get("roles") == roles) is None:
                raise RuntimeError(f"the proxy did not learn the roles {roles} in {READY_S} s")
            victim = child_named(local, f"sim-{victim_index}")
            held_out = functools.partial(
                _until, session, proxy, lambda r: r.get("circuit_open") == []
            )
            stop = await stopped_under_load(session, proxy, victim, config, held_out)
    finally:
        await local.aclose()
    back = None if stop.again is None else stop.again - stop.resumed_at
    return PdHungResult(
        config.stop_s, config.stream, *stop.figures(), back, config.half, config.protocol
    )


async def _until(
    session: aiohttp.ClientSession, proxy: str, ready: Callable[[dict[str, Any]], bool]
) -> float | None:
    """When (``perf_counter``) the proxy's ``/readyz`` detail first met ``ready``;
    ``None`` if not within :data:`READY_S`."""
    deadline = time.perf_counter() + READY_S
    while time.perf_counter() < deadline:
        try:
            async with session.get(f"{proxy}/readyz") as response:
                detail = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            detail = {}
        if isinstance(detail, dict) and ready(detail):
            return time.perf_counter()
        await asyncio.sleep(POLL_S)  # polling readiness, bounded by READY_S
    return None
