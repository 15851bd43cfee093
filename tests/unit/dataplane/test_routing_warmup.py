"""The proxy's side of warm-up (issue 41): it counts hot prefixes for its reports, and
keeps requests off a replica the control plane is warming, as ``Replica.warmup`` says."""

from __future__ import annotations

import json
import random
import time

from dataplane.fleet.state import FleetState
from dataplane.hot_prefixes import HotPrefixBook
from dataplane.openai_request import parse_inference
from dataplane.routing import Defaults, Prepared, Router
from kvcore.pb import routing_pb2
from tests.unit.dataplane.state_messages import delta, replica, snapshot

MODEL = "m"
SYSTEM = "The same long system prompt opens every request of this workload. " * 12


def fleet_and_router(warmup: dict[str, object], *replicas: routing_pb2.Replica) -> Router:
    workload = {"name": "default", "strategy": "kv_cost", "warmup": warmup}
    config = routing_pb2.RoutingConfig(
        revision=1,
        workloads=[routing_pb2.Workload(name="default", policy_json=json.dumps(workload))],
        models=[routing_pb2.Model(name=MODEL, tokenizer="builtin", block_size=16)],
    )
    fleet = FleetState(max_age_s=3600)
    for update in snapshot(1, 1, replicas, routing=config):
        fleet.apply(update)
    router = Router(fleet, Defaults(), random.Random(3))
    router.hot = HotPrefixBook()
    return router


def prepare(router: Router, question: str) -> Prepared:
    raw = json.dumps({"model": MODEL, "prompt": SYSTEM + question}).encode()
    return router.prepare(
        parse_inference(raw, "completion"),
        path="/v1/completions",
        headers={},
        api_key=None,
        request_id="t",
    )


def warming(ordinal: int, *pending: int) -> routing_pb2.Replica:
    info = replica(ordinal)
    info.warmup.warming = True
    info.warmup.pending_keys.extend(pending)
    return info


def test_distinct_prompts_sharing_a_system_prompt_make_it_a_reported_hot_prefix() -> None:
    router = fleet_and_router({"enabled": True, "min_requests": 3}, replica(0))
    for i in range(5):
        prepare(router, f"Question {i}?")  # each shorter than a block: only its tail differs
    assert router.hot is not None
    (hot,) = router.hot.report()
    assert hot.workload == "default" and hot.model == MODEL
    prepared = prepare(router, "Another?")
    assert list(hot.token_ids) and hot.key in prepared.block_keys


def test_a_workload_without_warm_up_keeps_nothing() -> None:
    router = fleet_and_router({"enabled": False}, replica(0))
    for i in range(10):
        prepare(router, f"Question {i}?")
    assert router.hot is not None and router.hot.report() == []


def test_a_warming_replica_gets_no_request_for_a_prefix_others_hold_until_it_warmed() -> None:
    router = fleet_and_router({"enabled": True, "new_prefix_share": 1.0}, replica(0), warming(1))
    prepared = prepare(router, "Where?")
    router.fleet.apply(
        delta(1, 2, residency=[routing_pb2.ResidencyChange(ordinal=0, added=prepared.block_keys)])
    )
    chosen = {
        router.choose(prepare(router, f"Q{i}?"), now=time.monotonic())[0].ordinal for i in range(20)
    }
    assert chosen == {0}
    done = replica(1)  # the warm-up ended: routed as any other again
    router.fleet.apply(delta(1, 3, replicas_upserted=[done]))
    assert not router.fleet.replicas.warming


def test_warming_never_leaves_a_request_without_a_replica() -> None:
    router = fleet_and_router({"enabled": True, "new_prefix_share": 0.0}, warming(0, 12345))
    decision, _ = router.choose(prepare(router, "Anyone?"), now=time.monotonic())
    assert decision.ordinal == 0
