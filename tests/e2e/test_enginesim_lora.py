"""kvroute-sim's LoRA adapters as a real process, as vLLM 0.33 and SGLang 0.5.23 serve
them: start-up lists, load and unload routes and their refusals, ``/v1/models``, requests
naming an adapter, and blocks keyed (and published) under the adapter."""

from __future__ import annotations

import json
from collections.abc import Iterator

import msgspec
import pytest

from tests.e2e.proxyproc import http_request
from tests.unit.enginesim.simproc import EventClient, SimProcess, cached_tokens

pytestmark = pytest.mark.e2e
PROMPT = list(range(30_000, 30_100))  # 6 full blocks of 16
GATE = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}


@pytest.fixture(scope="module")
def vllm() -> Iterator[SimProcess]:
    modules = 'sql=/adapters/sql {"name": "chat", "path": "/adapters/chat"}'
    args = (
        "--instant",
        "--model=base",
        "--enable-lora",
        "--max-loras=2",
        f"--lora-modules={modules}",
    )
    with SimProcess(*args, env=GATE) as proc:
        yield proc


def complete(sim: SimProcess, model: str, **extra: object) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, **extra}
    status, _, raw = http_request(sim.url + "/v1/completions", body)
    return status, json.loads(raw)


def post(sim: SimProcess, path: str, body: object) -> tuple[int, dict[str, str], bytes]:
    return http_request(sim.url + path, body)


def test_adapters_are_listed_with_their_parent_and_path(vllm: SimProcess) -> None:
    cards = {card["id"]: card for card in vllm.call("GET", "/v1/models")[1]["data"]}
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == "/adapters/sql"
    assert cards["chat"]["root"] == "/adapters/chat"
    assert cards["base"]["parent"] is None


def test_an_adapter_caches_apart_from_the_base_model_and_other_adapters(vllm: SimProcess) -> None:
    status, first = complete(vllm, "sql")
    assert status == 200 and first["model"] == "sql"
    assert cached_tokens(complete(vllm, "sql")[1]["usage"]) == 96
    assert cached_tokens(complete(vllm, "chat")[1]["usage"]) == 0
    assert cached_tokens(complete(vllm, "base")[1]["usage"]) == 0


def test_load_and_unload_as_vllm_answers(vllm: SimProcess) -> None:
    fresh = {"lora_name": "fresh", "lora_path": "/adapters/fresh"}
    status, headers, body = post(vllm, "/v1/load_lora_adapter", fresh)
    assert status == 200 and body == b"Success: LoRA adapter 'fresh' added successfully."
    assert "content-type" not in {k.lower() for k in headers}
    assert complete(vllm, "fresh")[0] == 200
    again = post(vllm, "/v1/load_lora_adapter", {"lora_name": "fresh", "lora_path": "/x"})
    assert again[0] == 400 and json.loads(again[2])["error"]["type"] == "InvalidUserInput"
    base = post(vllm, "/v1/load_lora_adapter", {"lora_name": "base", "lora_path": "/x"})
    assert base[0] == 400 and "conflicts with a served base model" in base[2].decode()
    gone = post(vllm, "/v1/unload_lora_adapter", {"lora_name": "fresh"})
    assert gone[0] == 200 and gone[2] == b"Success: LoRA adapter 'fresh' removed successfully."
    status, refused = complete(vllm, "fresh")
    assert status == 404 and refused["error"]["message"] == "The model `fresh` does not exist."
    missing = post(vllm, "/v1/unload_lora_adapter", {"lora_name": "fresh"})
    assert missing[0] == 404 and json.loads(missing[2])["error"]["type"] == "NotFoundError"
    assert post(vllm, "/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400  # no path


def test_without_the_env_gate_the_routes_do_not_exist() -> None:
    with SimProcess("--instant", "--enable-lora") as sim:
        status, _, body = post(sim, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"})
    assert status == 404 and json.loads(body) == {"detail": "Not Found"}


def test_events_carry_the_adapter_as_vllm_0_33_does(vllm: SimProcess) -> None:
    with EventClient(vllm) as events:
        events.connect_live()
        events.live.clear()
        prompt = list(range(31_000, 31_040))  # 2 full blocks
        post(vllm, "/v1/completions", {"model": "chat", "prompt": prompt, "max_tokens": 1})
        events.receive_available(timeout_ms=5000)
        batches = [msgspec.msgpack.decode(payload)[1] for payload in events.live.values()]
    events_seen = [event for batch in batches for event in batch]
    stored = [
        e for e in events_seen if e["type"] == "BlockStored" and e["token_ids"] == prompt[:32]
    ]
    assert stored, "no BlockStored for the adapter's prompt"
    event = stored[0]
    assert event["lora_name"] == "chat" and isinstance(event["lora_id"], int)
    assert event["extra_keys"] == [["chat"]] * len(event["block_hashes"])


def test_sglang_mode_serves_adapters_by_its_own_rules() -> None:
    args = ("--instant", "--model=base", "--event-format=sglang", "--enable-lora",
            "--lora-paths=sql=/adapters/sql", "--max-loaded-loras=2")  # fmt: skip
    with SimProcess(*args) as sim:
        loaded = post(sim, "/load_lora_adapter", {"lora_name": "a", "lora_path": "/adapters/a"})
        answer = json.loads(loaded[2])
        assert loaded[0] == 200 and answer["success"] is True
        assert answer["loaded_adapters"] == {"sql": "/adapters/sql", "a": "/adapters/a"}
        third = json.loads(
            post(sim, "/load_lora_adapter", {"lora_name": "b", "lora_path": "/b"})[2]
        )
        assert set(third["loaded_adapters"]) == {"a", "b"}  # sql, least recently used, out
        body = {"model": "base:a", "prompt": PROMPT, "max_tokens": 2}
        assert post(sim, "/v1/completions", body)[0] == 200
        generate = {"input_ids": PROMPT, "lora_path": "a", "sampling_params": {"max_new_tokens": 2}}
        status, _, raw = post(sim, "/generate", generate)
        assert status == 200 and json.loads(raw)["meta_info"]["cached_tokens"] == 96
        refused = post(sim, "/v1/completions", {**body, "model": "base:sql"})
        assert refused[0] == 400 and "never been loaded: sql" in refused[2].decode()
        dup = post(sim, "/load_lora_adapter", {"lora_name": "a", "lora_path": "/adapters/a"})
        assert dup[0] == 400 and json.loads(dup[2])["success"] is False
        cards = {card["id"]: card for card in sim.call("GET", "/v1/models")[1]["data"]}
        assert cards["a"]["parent"] == "base" and cards["a"]["root"] == "/adapters/a"
