"""The router and LoRA adapters: a request naming an adapter (vLLM's ``model``, SGLang's
``base:adapter`` or ``/generate``'s ``lora_path``) is keyed under the adapter, as the
engine keys its blocks, and offered only the replicas that announce it loaded."""

from __future__ import annotations

import json

import pytest

from dataplane.fleet.state import FleetState
from dataplane.http_errors import NotFound
from dataplane.openai_request import Kind, parse_inference
from dataplane.routing import Defaults, Prepared, Router
from kvcore.keys import chain_keys, root_key
from kvcore.pb import routing_pb2
from kvcore.tokenize import BuiltinTokenizer
from tests.unit.dataplane.state_messages import replica

PROMPT = "Translate the question into SQL over the orders table. " * 20
TOKENS = BuiltinTokenizer().encode(PROMPT)


def _router() -> Router:
    replicas = [replica(o, model="org/m") for o in range(3)]
    replicas[1].lora_adapters["sql"] = "/adapters/sql"
    chunk = routing_pb2.SnapshotChunk(chunk_index=0, last_chunk=True, replicas=replicas)
    fleet = FleetState(max_age_s=3600)
    fleet.apply(routing_pb2.StateUpdate(epoch=1, version=1, snapshot=chunk))
    return Router(fleet, Defaults())


def _prepare(router: Router, body: dict[str, object], kind: Kind = "completion") -> Prepared:
    path = {"completion": "/v1/completions", "generate": "/generate"}[kind]
    request = parse_inference(json.dumps(body).encode(), kind)
    return router.prepare(request, path=path, headers={}, api_key=None, request_id="t")


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"model": "sql", "prompt": PROMPT}, "completion"),
        ({"model": "org/m:sql", "prompt": PROMPT}, "completion"),  # SGLang's form
        ({"model": "any:sql", "prompt": PROMPT}, "completion"),
        ({"text": PROMPT, "lora_path": "sql"}, "generate"),
    ],
)
def test_an_adapter_is_keyed_under_it_and_offered_only_its_holder(
    body: dict[str, object], kind: Kind
) -> None:
    router = _router()
    prepared = _prepare(router, body, kind)
    assert prepared.lora_name == "sql" and prepared.key_model == "org/m"
    assert prepared.block_keys == chain_keys(root_key(model="org/m", lora_name="sql"), TOKENS)
    decision, _ = router.choose(prepared, now=0.0)
    assert decision.ordinal == 1


def test_the_base_model_is_keyed_apart_and_an_unknown_adapter_is_not_found() -> None:
    router = _router()
    base = _prepare(router, {"model": "org/m", "prompt": PROMPT})
    assert base.lora_name == "" and base.block_keys == chain_keys(root_key(model="org/m"), TOKENS)
    with pytest.raises(NotFound):
        _prepare(router, {"model": "org/m:nobody", "prompt": PROMPT})
    with pytest.raises(NotFound):
        _prepare(router, {"model": "nobody", "prompt": PROMPT})
