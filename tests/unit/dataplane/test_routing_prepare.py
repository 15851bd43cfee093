"""What Router.prepare computes: the explain endpoint's tokens, keys under the right root and
block size, and the workload a request is classified into."""

from __future__ import annotations

import json

import pytest

from dataplane.fleet import state as fleet_state
from dataplane.fleet.state import FleetState
from dataplane.http_errors import NotFound
from dataplane.openai_request import Kind, parse_inference
from dataplane.routing import Defaults, Prepared, Router
from kvcore.keys import chain_keys, root_key
from kvcore.pb import routing_pb2
from kvcore.request import prompt_token_ids
from kvcore.tenancy import cache_namespace, tenant_salt
from kvcore.tokenize import BuiltinTokenizer
from kvcore.workload import RoutingConfig, parse_config
from tests.unit.dataplane.state_messages import (
    MODEL,
    config,
    delta,
    model_entry,
    replica,
    residency_change,
    snapshot,
)

LONG = "".join(f"Line {i}: the router keys this prompt block by block.\n" for i in range(60))
KV_AWARE = {"name": "default", "strategy": "kv_aware"}
KV_COST = {"name": "default", "strategy": "kv_cost", "prefill_tokens_per_s": 10_000}
WORKLOADS = [
    {"name": "default", "strategy": "round_robin"},
    {"name": "isolated", "strategy": "round_robin", "tenant_isolation": True},
]


def _router(announced_block_size: int, registry: list[routing_pb2.Model]) -> Router:
    config = routing_pb2.RoutingConfig(
        revision=1,
        workloads=[
            routing_pb2.Workload(name=w["name"], policy_json=json.dumps(w)) for w in WORKLOADS
        ],
        models=registry,
    )
    replicas = [replica(o, model="org/m", served=["m"]) for o in range(2)]
    for info in replicas:
        info.block_size = announced_block_size
    chunk = routing_pb2.SnapshotChunk(
        chunk_index=0, last_chunk=True, config=config, replicas=replicas
    )
    fleet = FleetState(max_age_s=3600)
    fleet.apply(routing_pb2.StateUpdate(epoch=1, version=1, snapshot=chunk))
    return Router(fleet, Defaults())


def _prepare(
    router: Router, body: dict[str, object], kind: Kind, headers: dict[str, str] | None = None
) -> Prepared:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    request = parse_inference(json.dumps(body).encode(), kind)
    return router.prepare(request, path=path, headers=headers or {}, api_key=None, request_id="t")


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"model": "m", "messages": [{"role": "system", "content": LONG}]}, "chat"),
        ({"model": "m", "prompt": LONG, "cache_salt": "tenant-a"}, "completion"),
        ({"model": "m", "prompt": [LONG, "second prompt of the batch"]}, "completion"),
    ],
)
def test_the_router_keys_the_tokens_the_explain_endpoint_reads(
    body: dict[str, object], kind: Kind
) -> None:
    """Twice each (the second time through the prefix cache): the block keys are the
    chained keys of kvcore.request's tokens, rooted at the model id and the tenant."""
    router = _router(16, [])
    tokens = prompt_token_ids(body, BuiltinTokenizer(), kind)
    namespace = cache_namespace(body, tenant=None, isolating=False)  # a salt: its own
    root = root_key(model="org/m", namespace=namespace)
    for _ in range(2):
        prepared = _prepare(router, body, kind)
        assert prepared.prompt_tokens == len(tokens)
        assert prepared.block_keys == chain_keys(root, tokens, 16)


def test_a_model_the_registry_does_not_name_is_keyed_as_its_sidecars_announce() -> None:
    body = {"model": "m", "prompt": LONG}
    tokens = BuiltinTokenizer().encode(LONG)
    unnamed = _prepare(_router(32, []), body, "completion")
    assert unnamed.block_size == 32
    assert unnamed.block_keys == chain_keys(root_key(model="org/m"), tokens, 32)
    entry = routing_pb2.Model(name="m", tokenizer="builtin", block_size=64)
    assert _prepare(_router(32, [entry]), body, "completion").block_size == 64


def test_the_workload_header_picks_a_workload_and_tenants_get_their_own_root() -> None:
    router = _router(16, [])
    body = {"model": "m", "prompt": LONG, "prompt_cache_key": "tenant-b"}
    plain = _prepare(router, body, "completion")
    isolated = _prepare(router, body, "completion", {"x-kvroute-workload": "isolated"})
    assert (plain.workload.name, plain.namespace) == ("default", "")
    # no tenant known (no key, no tenant header): the client's key subdivides the shared one
    assert (isolated.workload.name, isolated.namespace) == ("isolated", tenant_salt("", "tenant-b"))
    tokens = BuiltinTokenizer().encode(LONG)
    isolated_root = root_key(model="org/m", namespace=tenant_salt("", "tenant-b"))
    assert isolated.block_keys == chain_keys(isolated_root, tokens)
    assert plain.block_keys == chain_keys(root_key(model="org/m"), tokens)


def test_what_a_model_name_resolves_to_follows_the_fleets_changes() -> None:
    """The router remembers a name's canonical id, tokenizer and block size until the
    replicas or the config change: each change below is seen by the next request."""
    router = _router(16, [])
    body = {"model": "m", "prompt": LONG}
    tokens = BuiltinTokenizer().encode(LONG)
    assert _prepare(router, body, "completion").block_size == 16
    announced = replica(0, model="org/m", served=["m"])
    announced.block_size = 32  # both replicas' sidecars now key with 32
    second = replica(1, model="org/m", served=["m"])
    second.block_size = 32
    router.fleet.apply(delta(1, 2, replicas_upserted=[announced, second]))
    prepared = _prepare(router, body, "completion")
    assert prepared.block_size == 32
    assert prepared.block_keys == chain_keys(root_key(model="org/m"), tokens, 32)
    registry = config(WORKLOADS, models=[model_entry("m")])
    registry.models[0].block_size = 64  # the registry names the model: its size wins
    router.fleet.apply(delta(1, 3, config=registry))
    assert _prepare(router, body, "completion").block_size == 64
    renamed = replica(0, model="org/other", served=["other"])
    router.fleet.apply(delta(1, 4, replicas_upserted=[renamed], replicas_removed=[1]))
    with pytest.raises(NotFound):  # nobody serves "m" any more
        _prepare(router, body, "completion")
    assert _prepare(router, {"model": "other", "prompt": LONG}, "completion").key_model == (
        "org/other"
    )


def test_a_static_replicas_served_names_end_the_any_name_routing() -> None:
    router = Router(FleetState.from_static(["http://127.0.0.1:9000"]), Defaults())
    body = {"model": "whatever", "prompt": "Hello"}
    assert _prepare(router, body, "completion").key_model == "whatever"
    router.fleet.set_served_names(0, ["org/m"])
    with pytest.raises(NotFound):
        _prepare(router, body, "completion")
    assert _prepare(router, {"model": "org/m", "prompt": "Hello"}, "completion").key_model == (
        "org/m"
    )


def test_a_request_routed_between_the_steps_of_a_delta_reads_its_new_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A delta is applied in steps with routing in between; its config is in force from
    its first step, as the registry is read (the rest of the delta still to come)."""
    monkeypatch.setattr(fleet_state, "STEP_KEYS", 10)
    router = _router(16, [])
    body = {"model": "m", "prompt": LONG}
    assert _prepare(router, body, "completion").block_size == 16
    registry = config(WORKLOADS, models=[model_entry("m")])
    registry.models[0].block_size = 64
    added = residency_change(0, added=list(range(1, 100)))
    steps = router.fleet.apply_steps(delta(1, 2, config=registry, residency=[added]))
    next(steps)
    assert _prepare(router, body, "completion").block_size == 64
    for _ in steps:
        pass
    assert _prepare(router, body, "completion").block_size == 64


@pytest.mark.parametrize(
    ("strategy", "static", "body", "keys_read", "keyed"),
    [
        ("round_robin", True, {"prompt": LONG}, False, False),  # nothing reads its keys
        ("least_load", True, {"prompt": LONG}, False, False),
        ("round_robin", True, {"prompt": LONG}, True, True),  # debug headers, traces
        ("prefix_hash", True, {"prompt": LONG}, False, True),  # the policy reads them
        ("round_robin", True, {"prompt": [LONG, "another"]}, False, True),  # a batch
        ("round_robin", True, {"prompt": LONG, "n": 2}, False, True),  # samples
        ("round_robin", False, {"prompt": LONG}, False, True),  # residency to predict from
    ],
)
def test_a_prompt_is_keyed_unless_nothing_would_read_its_keys(
    strategy: str, static: bool, body: dict[str, object], keys_read: bool, keyed: bool
) -> None:
    """Keying a short prompt is about a fifth of a static round_robin proxy's CPU per
    request, for keys nothing reads there; what is left unkeyed is keyed on demand (the
    fidelity counters, when an engine reports no prompt tokens) to the same figures."""
    if static:
        fleet = FleetState.from_static(["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
                                       default_routing=_routing(strategy))  # fmt: skip
        router = Router(fleet, Defaults())
    else:
        router = _router(16, [])
    request = parse_inference(json.dumps({"model": "m", **body}).encode(), "completion")
    prepared = router.prepare(request, path="/v1/completions", headers={}, api_key=None,
                              request_id="t", keys_read=keys_read)  # fmt: skip
    assert prepared.keyed is keyed
    tokens = prompt_token_ids({"prompt": LONG}, BuiltinTokenizer(), "completion")
    if not keyed:
        assert (prepared.prompt_tokens, prepared.block_keys) == (0, [])
        decision, predicted = router.choose(prepared, now=1.0)
        assert decision.replica is not None and predicted == 0  # routed all the same
        router.key(prepared, request)
    root = root_key(model="m" if static else "org/m", namespace="")
    assert prepared.prompt_tokens == len(tokens)
    assert prepared.block_keys == chain_keys(root, tokens, 16)


def _routing(strategy: str) -> RoutingConfig:
    return parse_config({"workloads": [{"name": "default", "strategy": strategy}]})


def test_a_batchs_later_prompts_are_keyed_and_counted_only_while_prefill_books_are_kept() -> None:
    """A batch is routed by its first prompt; with a kv_cost workload the proxy books what
    the others leave to prefill on the chosen replica: each prompt's tokens less what the
    replica holds of it or the batch's earlier prompts bring (the engine runs them as
    requests of its own, each hitting the blocks of those before it)."""
    first = list(range(1000, 1160))  # 10 blocks, resident on replica 0, and the batch's
    held = list(range(20000, 20064))  # 4 blocks replica 0 holds, no other prompt's
    batch = [first, first + list(range(5000, 5040)), first + list(range(5000, 5040)),
             list(range(9000, 9040)), held + list(range(30000, 30020))]  # fmt: skip
    texts = [LONG, LONG + "One more line.", "A prompt of its own."]
    root = root_key(model=MODEL)
    for workload, books in ((KV_AWARE, False), (KV_COST, True)):
        fleet = FleetState(max_age_s=3600)
        fleet.apply(snapshot(1, 1, [replica(0), replica(1)], routing=config([workload]))[0])
        resident = chain_keys(root, first, 16) + chain_keys(root, held, 16)
        fleet.apply(delta(1, 2, residency=[residency_change(0, resident)]))
        router = Router(fleet, Defaults())
        prepared = _prepare(router, {"model": MODEL, "prompt": batch}, "completion")
        in_words = _prepare(router, {"model": MODEL, "prompt": texts}, "completion")
        if not books:
            assert prepared.later == in_words.later == ()
            continue
        assert [list(p.tokens) for p in prepared.later] == batch[1:]
        assert [p.keys for p in prepared.later] == [chain_keys(root, p, 16) for p in batch[1:]]
        assert [list(p.tokens) for p in in_words.later] == [
            prompt_token_ids({"prompt": text}, BuiltinTokenizer(), "completion")
            for text in texts[1:]
        ]
        # 200 tokens less the first prompt's 160; its repeat: the last partial block (8);
        # 40 new; 84 less the 64 replica 0 holds (all 84 on replica 1)
        assert router.later_uncached(prepared, 0, now=1.0) == 40 + 8 + 40 + 20
        assert router.later_uncached(prepared, 1, now=1.0) == 40 + 8 + 40 + 84
