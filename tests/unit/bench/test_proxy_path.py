"""bench.proxy_path drives the real request path in memory and reports its CPU per request."""

from __future__ import annotations

import sys
from collections import Counter
from types import FrameType
from typing import Any

import pytest
import uvloop

from bench.proxy import short_prompt
from bench.proxy_path import (
    BATCHES,
    CLIENTS,
    SPLIT,
    _Path,
    _service,
    measure,
    measure_split,
    shared_prompt,
)
from dataplane import native
from dataplane import service as service_module
from dataplane.fleet.inflight import Inflight
from dataplane.fleet.state import FleetState


def test_every_request_goes_through_the_proxy_and_each_batch_is_timed() -> None:
    samples = uvloop.run(measure(requests=100, strategy="prefix_hash", profile=False, warmup=20))
    assert len(samples) == BATCHES
    assert all(0 < sample < 1_000_000 for sample in samples)  # microseconds per request


def test_the_split_times_every_request_in_order_of_its_path() -> None:
    parts = uvloop.run(measure_split(requests=50, strategy="round_robin", warmup=10))
    assert set(parts) == set(SPLIT) == {"in", "out", "after"}
    for values in parts.values():
        assert len(values) == 50
        assert all(0 <= value < 1_000_000 for value in values)  # microseconds
    assert all(value > 0 for value in parts["in"] + parts["out"])


def test_kv_aware_runs_without_debug_headers_as_bench_proxy_runs_it() -> None:
    assert _service("kv_aware").settings.debug_headers
    assert not _service("kv_aware", debug_headers=False).settings.debug_headers
    samples = uvloop.run(
        measure(requests=50, strategy="kv_aware", profile=False, warmup=10, debug_headers=False)
    )
    assert len(samples) == BATCHES


def test_the_shared_prompts_take_kv_awares_keyed_path_on_blocks_both_replicas_hold() -> None:
    """--prompt shared: bench.proxy's throughput prompts, whose two whole blocks the
    routing state shows on both replicas; kv_aware matches them and predicts the hit."""

    async def answers() -> list[bytes]:
        path = _Path("kv_aware", prompt="shared")  # debug headers on: they show the match
        await path.start()
        try:
            return [await path.one(i) for i in range(2 * CLIENTS)]
        finally:
            await path.aclose()

    replies = uvloop.run(answers())
    assert all(b"\r\nx-kvroute-prefix-blocks: 2/2\r\n" in reply for reply in replies)
    assert {_replica_of(reply) for reply in replies} == {"r0", "r1"}  # both hold them
    assert all(b'"cached_tokens": 32' in reply for reply in replies)
    assert shared_prompt(0) == short_prompt(0, 0)
    assert shared_prompt(CLIENTS + 3) == short_prompt(3, 1)


def test_the_default_prompt_has_no_whole_block_to_match() -> None:
    async def answer() -> bytes:
        path = _Path("kv_aware")
        await path.start()
        try:
            return await path.one(7)
        finally:
            await path.aclose()

    assert b"\r\nx-kvroute-prefix-blocks: 0/0\r\n" in uvloop.run(answer())


def _replica_of(reply: bytes) -> str:
    head = reply.split(b"\r\n\r\n", 1)[0].decode()
    return next(
        line.split(": ", 1)[1]
        for line in head.split("\r\n")
        if line.startswith("x-kvroute-replica")
    )


def test_concurrent_clients_keep_several_requests_in_flight_at_the_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--concurrency N: N connections sending at once, as bench.proxy's throughput runs."""
    in_flight: list[int] = []

    class CountedInflight(Inflight):  # a subclass: a compiled object's methods stay as they are
        def on_sent(self, *args: Any, **kwargs: Any) -> Any:
            ticket = super().on_sent(*args, **kwargs)
            in_flight.append(self.total())
            return ticket

    class CountedFleet(FleetState):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(inflight=CountedInflight, **kwargs)

    monkeypatch.setattr(service_module, "FleetState", CountedFleet)

    async def send() -> None:
        path = _Path("kv_aware", prompt="shared", concurrency=8)
        await path.start()
        try:
            await path.many(0, 64)
        finally:
            await path.aclose()

    uvloop.run(send())
    assert len(in_flight) == 64  # every request sent once
    assert max(in_flight) == 8
    samples = uvloop.run(
        measure(requests=100, strategy="round_robin", profile=False, warmup=16, concurrency=8)
    )
    assert len(samples) == BATCHES


@pytest.mark.parametrize(("strategy", "prompt"), [("round_robin", "hello"), ("kv_aware", "shared")])
def test_no_init_that_dataclass_generates_runs_for_a_routed_request(
    strategy: str, prompt: str
) -> None:
    """mypyc compiles no method ``@dataclass`` generates: a generated ``__init__`` runs
    interpreted (ReplicaState's cost 0.80 us against 0.16 compiled), so each class of the
    compiled modules that a request builds writes its own."""
    generated: Counter[str] = Counter()

    def count(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_name == "__init__" and code.co_filename == "<string>":
            cls = type(frame.f_locals["self"])
            if cls.__module__ in native.MODULES:
                generated[f"{cls.__module__}.{cls.__qualname__}"] += 1

    _route_watched(strategy, prompt, count)
    assert generated == Counter()


# what a routed request may run of the project's code that is not compiled (module ->
# why): the rest of its path is dataplane/native.py's MODULES, and a call from compiled
# code into a module run from source costs about as much as the work of several
# compiled functions (the 2026-12-05/06 changes had put the first-byte deadlines, the P/D
# split and the LoRA placement on every request from source: docs/benchmarks.md, Proxy)
FROM_SOURCE = {
    "dataplane.relay": "reads the answer's usage with msgspec",
    "dataplane.reporter": "counts for the control plane",
    "kvcore.workload.classify": "names the request's workload",
    "kvcore.index.base": "checks a replica's ordinal",
    "kvcore.index.compact": "the compact index's lookup, in C, and its speculation",
}


@pytest.mark.parametrize(("strategy", "prompt"), [("round_robin", "hello"), ("kv_aware", "shared")])
def test_a_routed_request_runs_the_project_code_from_source_only_where_named(
    strategy: str, prompt: str
) -> None:
    """Compiled or not, the project modules a routed request calls into are the compiled
    ones and those ``FROM_SOURCE`` names (a module added to the path must be compiled, or
    named there with its reason)."""
    modules: Counter[str] = Counter()

    def count(frame: FrameType, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.partition(".")[0] in ("dataplane", "kvcore", "kvruntime"):
            modules[module] += 1

    _route_watched(strategy, prompt, count)
    from_source = set(modules) - set(native.MODULES)
    assert from_source <= set(FROM_SOURCE), from_source - set(FROM_SOURCE)


def _route_watched(strategy: str, prompt: str, hook: Any) -> None:
    """64 requests routed in memory (after 8 that warm the path up) with ``hook`` as
    the profile function (``sys.setprofile``) while they run."""

    async def route() -> None:
        path = _Path(strategy, debug_headers=False, prompt=prompt, concurrency=4)
        await path.start()
        try:
            await path.many(0, 8)  # connections, metric children, the tokenizer's memo
            sys.setprofile(hook)
            try:
                await path.many(8, 64)
            finally:
                sys.setprofile(None)
        finally:
            await path.aclose()

    uvloop.run(route())
