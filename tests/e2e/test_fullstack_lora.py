"""Adapter-aware routing through the whole stack (issue 41 item 3): three ``kvroute-sim``
replicas with LoRA on, one holding adapter ``sql``; sidecars, control plane and proxy as
``kvroute up`` runs them. A request naming an adapter goes only to its holder, keyed
under the adapter; an unknown adapter is OpenAI's 404; the proxy's load and unload
routes act on the pool; an unloaded adapter stops being routed to."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.fullstack import FullStack, wait_for
from tests.unit.enginesim.simproc import SimProcess

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

MODEL = "sim-model"
SIM_ARGS = ("--instant", "--max-model-len=8192", f"--model={MODEL}", "--enable-lora",
            "--max-loras=4")  # fmt: skip
GATE = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
ENV = {"KVROUTE_LOAD_INTERVAL_S": "0.2"}
PROMPT = "Translate the question into SQL over the orders table, and nothing else. " * 30


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullStack]:
    with ExitStack() as started:
        sims = [
            started.enter_context(SimProcess(*SIM_ARGS, *extra, env=GATE))
            for extra in (("--lora-modules=sql=/adapters/sql",), (), ())
        ]
        fleet = started.enter_context(FullStack(sims, tmp_path_factory.mktemp("fleet"), ENV))
        wait_for(lambda: fleet.readyz()["replicas"] == 3, "every replica in the proxy")
        wait_for(lambda: bool(holders(fleet, "sql")), "the adapter announced")
        yield fleet


def holders(stack: FullStack, adapter: str) -> set[str]:
    status, body = stack.admin("GET", "/v1/replicas")
    assert status == 200
    return {r["replica_id"] for r in body["replicas"] if adapter in r["lora_adapters"]}


def complete(stack: FullStack, model: str, question: str) -> tuple[int, dict[str, str], dict]:
    body = {"model": model, "prompt": PROMPT + question, "max_tokens": 2}
    status, headers, raw = stack.request("/v1/completions", body)
    return status, headers, json.loads(raw)


def test_an_adapter_is_routed_only_to_its_holder_and_keyed_under_it(stack: FullStack) -> None:
    (holder,) = holders(stack, "sql")
    chosen = []
    for i in range(6):
        status, headers, answer = complete(stack, "sql", f" Question {i}?")
        assert status == 200 and answer["model"] == "sql"
        chosen.append(headers["x-kvroute-replica"])
    assert set(chosen) == {holder}
    # the router predicts the adapter's shared prefix cached on its holder (keyed alike)
    _, headers, answer = complete(stack, "sql", " One more?")
    assert int(headers["x-kvroute-prefix-blocks"].split("/")[0]) > 0
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_an_adapter_nobody_has_is_openais_404(stack: FullStack) -> None:
    status, _, answer = complete(stack, "nobody-has-this", " Hello?")
    assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_the_proxys_load_and_unload_act_on_the_pool(stack: FullStack) -> None:
    load = {"lora_name": "chat", "lora_path": "/adapters/chat"}
    status, _, body = stack.request("/v1/load_lora_adapter", load)
    assert status == 200 and b"added successfully" in body
    wait_for(lambda: len(holders(stack, "chat")) == 3, "chat on every replica")
    bad = stack.request("/v1/load_lora_adapter", {"lora_name": "no spaces", "lora_path": "/x"})
    assert bad[0] == 400 and json.loads(bad[2])["error"]["code"] == "invalid_lora_name"

    status, _, _ = stack.request("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200
    wait_for(lambda: not holders(stack, "chat"), "chat unloaded everywhere")
    wait_for(lambda: complete(stack, "chat", " Hi?")[0] == 404, "chat no longer routed", 5)


def test_a_load_workload_loads_a_missing_adapter_onto_one_replica(stack: FullStack) -> None:
    workload = {"strategy": "kv_aware", "lora_on_miss": "load"}
    assert stack.admin("PUT", "/v1/workloads/adapters", workload)[0] in (200, 201)
    header = {"x-kvroute-workload": "adapters"}
    engine = stack.engines[2]  # the proxy learns the path from the announce, then it goes
    engine.post("/v1/load_lora_adapter", {"lora_name": "ops", "lora_path": "/adapters/ops"})
    wait_for(lambda: bool(holders(stack, "ops")), "ops announced")
    engine.post("/v1/unload_lora_adapter", {"lora_name": "ops"})
    wait_for(lambda: not holders(stack, "ops"), "ops unloaded")
    assert complete(stack, "ops", " Refused?")[0] == 404  # the default workload refuses

    body = {"model": "ops", "prompt": PROMPT + " Loaded?", "max_tokens": 2}
    wait_for(lambda: stack.request("/v1/completions", body, **header)[0] == 200, "the workload")
    wait_for(lambda: len(holders(stack, "ops")) == 1, "ops announced by its new holder")
    (holder,) = holders(stack, "ops")
    for i in range(4):  # and then routed to that holder as any adapter is
        status, headers, _ = stack.request(
            "/v1/completions", {**body, "prompt": PROMPT + f" {i}?"}, **header
        )
        assert status == 200 and headers["x-kvroute-replica"] == holder
    assert len(holders(stack, "ops")) == 1
    assert adapter_changes(stack, "load", "ok") >= 1  # what operators watch per minute


def adapter_changes(stack: FullStack, action: str, outcome: str) -> float:
    text = stack.request("/metrics", method="GET")[2].decode()
    family = next(
        f for f in text_string_to_metric_families(text)
        if f.name == "kvroute_proxy_lora_adapter_changes"
    )  # fmt: skip
    return sum(
        s.value for s in family.samples
        if s.name.endswith("_total") and s.labels == {"action": action, "outcome": outcome}
    )  # fmt: skip
