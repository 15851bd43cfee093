"""Warm-up and drain through the whole fleet (issue 41): sims, sidecars, control plane, proxy.

A workload with warm-up on: the proxy counts its hot prefix (a system prompt many
distinct requests began with) and reports it; a replica whose cache is cleared joins
empty, and the control plane's leader warms it with that prefix through the engine's
own API before any client request reaches it, as its KV events confirm; so is an engine
restarted (stopped, started again empty on the same ports). Then a replica is drained
under load: no request is lost, its lone hot prefix is sent to the
other replica first, and the next request there is a hit. Last, with the workload's
warm-up ``source: transfer``, a restarted engine is warmed by KV transfer: the other
replica, holding the prefix, runs it as a cache hit and the restarted one reads its
blocks instead of computing them (enginesim's vLLM P/D protocol).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.fullstack import FullStack, wait_for
from tests.e2e.proxyproc import http_request
from tests.unit.enginesim.simproc import SimProcess

MODEL = "sim-model"
SYSTEM = "Every answer is checked by two engineers before it leaves the building. " * 30
SIM_ARGS = ("--instant", "--max-model-len=8192", f"--model={MODEL}")
ENV = {"KVROUTE_REPORT_INTERVAL_S": "0.3", "KVROUTE_LOAD_INTERVAL_S": "0.2"}
WARMUP = {"enabled": True, "min_requests": 3, "tokens_per_s": 100_000}


@pytest.fixture(scope="module")
def started() -> Iterator[ExitStack]:
    """What the module started (engines a test restarts join it)."""
    with ExitStack() as stack:
        yield stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, started: ExitStack) -> FullStack:
    sims = [started.enter_context(SimProcess(*SIM_ARGS)) for _ in range(2)]
    fleet = started.enter_context(FullStack(sims, tmp_path_factory.mktemp("fleet"), ENV))
    wait_for(lambda: fleet.readyz()["replicas"] == 2, "every replica in the proxy")
    workload = {"strategy": "kv_cost", "warmup": WARMUP}
    assert fleet.admin("PUT", "/v1/workloads/default", workload)[0] in (200, 201)
    return fleet


def ask(stack: FullStack, question: str) -> tuple[int, dict[str, str], Any]:
    body = {"model": MODEL, "prompt": SYSTEM + question, "max_tokens": 2}
    status, headers, answer = stack.request("/v1/completions", body)
    return status, headers, json.loads(answer)


def replica(stack: FullStack, replica_id: str) -> dict[str, Any]:
    status, body = stack.admin("GET", "/v1/replicas")
    assert status == 200
    (found,) = [r for r in body["replicas"] if r["replica_id"] == replica_id]
    return dict(found)


def controlplane_metric(stack: FullStack, name: str, **labels: str) -> float:
    _, _, text = http_request(stack.fleet.admin_urls[0] + "/metrics", None, method="GET")
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def served(sim: SimProcess) -> float:
    return sim.metric("vllm:e2e_request_latency_seconds_count")


def cached_tokens(answer: Any) -> int:
    """The engine's ``cached_tokens``; 0 on a miss, where vLLM reports no details."""
    return int((answer["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0))


def test_a_replica_whose_cache_was_cleared_is_warmed_before_traffic_reaches_it(
    stack: FullStack,
) -> None:
    owners: list[str] = []

    def another_question() -> bool:  # distinct prompts, until the prefix is reported hot
        owners.append(ask(stack, f"Question number {len(owners)}?")[1]["x-kvroute-replica"])
        return controlplane_metric(stack, "kvroute_controlplane_hot_prefixes") >= 1

    wait_for(another_question, "the proxy's hot prefix to reach the control plane")
    owner = owners[-1]
    sim = stack.engines[int(owner.removeprefix("r"))]
    assert replica(stack, owner)["resident_blocks"] > 0
    before = served(sim)
    assert sim.call("POST", "/reset_prefix_cache")[0] == 200  # the cache cleared: empty
    # the leader warms it with the hot prefix, and its own KV events confirm it, with no
    # client request sent in the meantime
    wait_for(
        lambda: (
            (replica(stack, owner).get("warmup") or {}).get("warming") is False
            and replica(stack, owner)["warmup"]["workloads"][0]["outcome"] == "done"
        ),
        "the warm-up to be confirmed by the replica's KV events",
    )
    warmup = replica(stack, owner)["warmup"]["workloads"][0]
    assert warmup["sent"] >= 1 and warmup["confirmed"] == warmup["planned"] >= 1
    assert warmup["failed"] == 0
    assert replica(stack, owner)["resident_blocks"] >= len(SYSTEM) // 4 // 16 // 2
    assert served(sim) - before == warmup["sent"]  # only the warm-up's requests came
    # the first client request once the proxy holds that state is a hit on the warmed
    # prefix (one delta earlier the proxy still kept the prefix off the warming replica)
    stack.wait_proxy_caught_up()
    status, headers, answer = ask(stack, "After the clear?")
    assert status == 200
    assert cached_tokens(answer) >= 256, headers
    assert (
        controlplane_metric(stack, "kvroute_controlplane_warmup_prefixes_total", result="sent") >= 1
    )


def test_a_restarted_engine_is_warmed_before_traffic_reaches_it(
    stack: FullStack, started: ExitStack
) -> None:
    owner = ask(stack, "Who holds it now?")[1]["x-kvroute-replica"]
    index = int(owner.removeprefix("r"))
    confirmed = controlplane_metric(
        stack, "kvroute_controlplane_warmup_prefixes_total", result="confirmed"
    )
    engine = restart(stack, started, index)
    wait_for(
        lambda: (
            controlplane_metric(
                stack, "kvroute_controlplane_warmup_prefixes_total", result="confirmed"
            )
            > confirmed
            and (replica(stack, owner).get("warmup") or {}).get("warming") is False
        ),
        "the restarted engine's warm-up to be confirmed by its KV events",
    )
    warmup = replica(stack, owner)["warmup"]["workloads"][0]
    assert warmup["outcome"] == "done" and warmup["sent"] >= 1
    assert served(engine) == warmup["sent"]  # nothing but the warm-up reached it yet
    # its cache holds the prompt's shared beginning: the first request is a hit
    body = {"model": MODEL, "prompt": SYSTEM + "After the restart?", "max_tokens": 2}
    answer = engine.post("/v1/completions", body)
    assert cached_tokens(answer) >= 256


def restart(stack: FullStack, started: ExitStack, index: int) -> SimProcess:
    """Engine ``index`` stops; the same one starts again, empty, on the same ports."""
    old = stack.engines[index]
    port = old.url.rsplit(":", 1)[1]
    assert old.proc is not None
    old.proc.terminate()
    old.proc.wait(timeout=30)
    again = (
        f"--port={port}",
        f"--kv-events-endpoint={old.events}",
        f"--replay-endpoint={old.replay}",
    )
    engine = started.enter_context(SimProcess(*SIM_ARGS, *again))
    stack.engines[index] = engine
    return engine


def test_a_drained_replica_loses_no_request_and_its_hot_prefix_moves_first(
    stack: FullStack,
) -> None:
    owner = ask(stack, "Who holds it?")[1]["x-kvroute-replica"]
    other = "r1" if owner == "r0" else "r0"
    statuses: list[int] = []

    def load(count: int) -> None:
        for i in range(count):
            statuses.append(ask(stack, f"Under load {threading.get_ident()} {i}?")[0])

    workers = [threading.Thread(target=load, args=(15,)) for _ in range(4)]
    for worker in workers:
        worker.start()
    status, body = stack.admin("POST", f"/v1/replicas/{owner}/drain")
    assert status == 200 and body["draining"] is True
    for worker in workers:
        worker.join(timeout=120)
    assert statuses == [200] * 60  # not one request lost to the drain
    wait_for(
        lambda: ask(stack, "Where now?")[1]["x-kvroute-replica"] == other,
        "the proxy to stop routing to the drained replica",
    )
    for i in range(5):
        status, headers, answer = ask(stack, f"After the drain {i}?")
        assert status == 200 and headers["x-kvroute-replica"] == other
        assert cached_tokens(answer) >= 256, headers
    stack.admin("POST", f"/v1/replicas/{owner}/undrain")


def test_a_restarted_engine_is_warmed_by_kv_transfer_from_a_replica_holding_the_prefix(
    stack: FullStack, started: ExitStack
) -> None:
    workload = {"strategy": "kv_cost", "warmup": {**WARMUP, "source": "transfer"}}
    assert stack.admin("PUT", "/v1/workloads/default", workload)[0] == 200
    asked = [0]

    def hot() -> bool:  # the prefix reported hot (so far in the module, or now)
        asked[0] += 1
        ask(stack, f"Transfer question {asked[0]}?")
        return controlplane_metric(stack, "kvroute_controlplane_hot_prefixes") >= 1

    wait_for(hot, "the proxy's hot prefix to reach the control plane")
    holder = ask(stack, "Who holds it for the transfer?")[1]["x-kvroute-replica"]
    source = stack.engines[int(holder.removeprefix("r"))]
    joiner_id = "r1" if holder == "r0" else "r0"
    hits, prompts = (
        source.metric(f"vllm:{n}_total") for n in ("prefix_cache_hits", "prompt_tokens")
    )
    moved = controlplane_metric(stack, "kvroute_controlplane_warmup_prefixes_total", result="moved")
    # it held something before (a replica found empty once is warmed once, until it
    # has held blocks again): its restart is then a join, empty
    index = int(joiner_id.removeprefix("r"))
    stack.engines[index].post("/v1/completions", {"model": MODEL, "prompt": "Hello " * 64})
    wait_for(lambda: replica(stack, joiner_id)["resident_blocks"] > 0, "the joiner's blocks")
    joiner = restart(stack, started, index)
    wait_for(
        lambda: (
            controlplane_metric(stack, "kvroute_controlplane_warmup_prefixes_total", result="moved")
            > moved
            and (replica(stack, joiner_id).get("warmup") or {}).get("warming") is False
        ),
        "the restarted engine's warm-up by transfer to be confirmed by its KV events",
    )
    warmup = replica(stack, joiner_id)["warmup"]["workloads"][0]
    assert warmup["outcome"] == "done" and warmup["confirmed"] == warmup["planned"] >= 1
    assert replica(stack, joiner_id)["resident_blocks"] >= len(SYSTEM) // 4 // 16 // 2
    assert served(joiner) == warmup["sent"]  # nothing but the warm-up reached it yet
    # the holder ran each prefix as a cache hit (one request each, all but its last block
    # found cached), and handed the blocks over (none held any longer)
    sent_tokens = source.metric("vllm:prompt_tokens_total") - prompts
    assert sent_tokens > 0
    assert source.metric("vllm:prefix_cache_hits_total") - hits >= sent_tokens - 16 * warmup["sent"]
    assert source.call("GET", "/sim/state")[1]["kv_transfers_held"] == 0
    # the joiner computed none of its prompt tokens: each was read from the holder (vLLM's
    # connector hits) or, where two warmed prefixes share their beginning and one move
    # landed before the other was admitted, found in its own cache, which only an earlier
    # move of this warm-up filled (it started empty and nothing else reached it)
    assert joiner.metric("vllm:prompt_tokens_total") == sent_tokens
    read = joiner.metric("vllm:external_prefix_cache_hits_total")
    found = joiner.metric("vllm:prefix_cache_hits_total")
    assert read > 0 and read + found == sent_tokens
    assert found == 0 or warmup["sent"] > 1
    assert (
        controlplane_metric(stack, "kvroute_controlplane_warmup_prefixes_total", result="fell_back")
        == 0
    )
    body = {"model": MODEL, "prompt": SYSTEM + "After the transfer?", "max_tokens": 2}
    assert cached_tokens(joiner.post("/v1/completions", body)) >= 256
