"""The session id a session-affinity workload routes on: from its header or body field."""

from __future__ import annotations

import json
import time

import pytest

from dataplane.fleet.state import FleetState
from dataplane.openai_request import parse_inference
from dataplane.routing import Defaults, Router
from kvcore.pb import routing_pb2

MODEL = "m"


def _router(workloads: list[dict[str, str]]) -> Router:
    config = routing_pb2.RoutingConfig(
        revision=1,
        workloads=[
            routing_pb2.Workload(name=w["name"], policy_json=json.dumps(w)) for w in workloads
        ],
        models=[routing_pb2.Model(name=MODEL, tokenizer="builtin", block_size=16)],
    )
    replica = routing_pb2.Replica(
        ordinal=0, replica_id="r0", pool="default", base_url="http://10.0.0.1:8000",
        model=MODEL, status=routing_pb2.REPLICA_STATUS_HEALTHY, capacity_seqs=8,
    )  # fmt: skip
    chunk = routing_pb2.SnapshotChunk(
        chunk_index=0, last_chunk=True, config=config, replicas=[replica]
    )
    fleet = FleetState(max_age_s=3600)
    fleet.apply(routing_pb2.StateUpdate(epoch=1, version=1, snapshot=chunk))
    return Router(fleet, Defaults())


@pytest.mark.parametrize(
    ("workload", "headers", "body", "session"),
    [
        ({"strategy": "session_affinity"}, {"x-session-id": "s1"}, {}, "s1"),
        ({"strategy": "session_affinity"}, {}, {}, None),
        ({"strategy": "session_affinity", "session_key": "body.user"}, {}, {"user": "u"}, "u"),
        ({"strategy": "round_robin"}, {"x-session-id": "s1"}, {}, None),
    ],
)
def test_the_session_id_comes_from_the_workloads_session_key(
    workload: dict[str, str], headers: dict[str, str], body: dict[str, str], session: str | None
) -> None:
    router = _router([{"name": "default", **workload}])
    raw = json.dumps({"model": MODEL, "prompt": "hello", **body}).encode()
    prepared = router.prepare(
        parse_inference(raw, "completion"), path="/v1/completions", headers=headers,
        api_key=None, request_id="t",
    )  # fmt: skip
    assert prepared.session_id == session
    decision, _ = router.choose(prepared, now=time.monotonic())
    assert decision.replica_id == "r0"
