"""A proxy's place among the routers behind its balancer, as the control plane numbers
it (``Router.take_place``): where kv_cost's turn for new prompts starts."""

from __future__ import annotations

import json

import pytest

from dataplane.fleet.state import FleetState
from dataplane.openai_request import parse_inference
from dataplane.routing import Defaults, Router
from kvcore.pb import routing_pb2

MODEL = "m"


def _router(replicas: int) -> Router:
    config = routing_pb2.RoutingConfig(
        revision=1,
        workloads=[routing_pb2.Workload(name="default", policy_json='{"strategy": "kv_cost"}')],
        models=[routing_pb2.Model(name=MODEL, tokenizer="builtin", block_size=16)],
    )
    rows = [
        routing_pb2.Replica(
            ordinal=i, replica_id=f"r{i}", pool="default", base_url=f"http://10.0.0.{i + 1}:8000",
            model=MODEL, status=routing_pb2.REPLICA_STATUS_HEALTHY, capacity_seqs=8,
        )
        for i in range(replicas)
    ]  # fmt: skip
    chunk = routing_pb2.SnapshotChunk(chunk_index=0, last_chunk=True, config=config, replicas=rows)
    fleet = FleetState(max_age_s=3600)
    fleet.apply(routing_pb2.StateUpdate(epoch=1, version=1, snapshot=chunk))
    return Router(fleet, Defaults())


def _new_prompt(router: Router, n: int) -> str:
    raw = json.dumps({"model": MODEL, "prompt": f"conversation {n} " * 64}).encode()
    prepared = router.prepare(
        parse_inference(raw, "completion"), path="/v1/completions", headers={},
        api_key=None, request_id=f"t{n}",
    )  # fmt: skip
    decision, _ = router.choose(prepared, now=1.0)
    return decision.replica_id


@pytest.mark.parametrize(("place", "first"), [(0, "r0"), (1, "r4"), (2, "r2"), (3, "r6")])
def test_new_prompts_start_at_the_place_the_control_plane_numbered_this_proxy(
    place: int, first: str
) -> None:
    """Proxies of a Deployment are started alike; the control plane numbers their watches
    0, 1, 2, ... and each proxy's turn for new prompts starts that far round the fleet
    (0, 1/2, 1/4, 3/4 of it), not at a random replica, so four proxies taking turns in
    step send a burst of new prompts to four different replicas."""
    router = _router(8)
    router.take_place(place)
    assert _new_prompt(router, 0) == first
