"""What the routing-decision benchmarks decide over: long chat prompts that share their
first 90%, and a 64-replica ``kv_aware`` fleet in the proxy's own ``FleetState``.

``bench.micro``'s tokenize figures and ``bench.proxy``'s decision figures time the same
decision, in CPU and in wall time; they build its inputs here, once.
"""

from __future__ import annotations

import random
import time
from typing import Any

from dataplane.fleet.state import FleetState
from kvcore.pb import events_pb2, routing_pb2
from kvcore.tokenize import Tokenizer

FLEET_MODEL = "kvroute/sim-model"
REPLICAS = 64


def words() -> list[str]:
    """3,000 made-up words, the same every run."""
    rng = random.Random(5)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    return ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(3000)]


def text_of(tokenizer: Tokenizer, tokens: int, rng: random.Random, vocabulary: list[str]) -> str:
    """Sentences of ``vocabulary`` until ``tokenizer`` counts at least ``tokens``."""
    lines: list[str] = []
    while len(tokenizer.encode("".join(lines), add_special_tokens=False)) < tokens:
        lines.extend(_sentence(rng, vocabulary) for _ in range(20))
    return "".join(lines)


def chat(system: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def decision_fleet(spec: str, block_size: int) -> FleetState:
    """:data:`REPLICAS` healthy replicas of :data:`FLEET_MODEL` (tokenizer ``spec``) with
    assorted load, routed by ``kv_aware``."""
    config = routing_pb2.RoutingConfig(
        revision=1,
        workloads=[routing_pb2.Workload(name="default", policy_json='{"strategy": "kv_aware"}')],
        models=[routing_pb2.Model(name=FLEET_MODEL, tokenizer=spec, block_size=block_size)],
    )
    replicas = [
        routing_pb2.Replica(
            ordinal=i,
            replica_id=f"r{i}",
            pool="default",
            base_url=f"http://10.0.0.{i}:8000",
            model=FLEET_MODEL,
            status=routing_pb2.REPLICA_STATUS_HEALTHY,
            capacity_seqs=256,
            load=events_pb2.LoadReport(running=i % 7, waiting=i % 3, kv_usage=0.3, ts=time.time()),
        )
        for i in range(REPLICAS)
    ]
    chunk = routing_pb2.SnapshotChunk(
        chunk_index=0, last_chunk=True, config=config, replicas=replicas
    )
    fleet = FleetState(max_age_s=3600)
    fleet.apply(routing_pb2.StateUpdate(epoch=1, version=1, snapshot=chunk))
    return fleet


def hold(fleet: FleetState, ordinal: int, keys: list[int], version: int = 2) -> None:
    """Replica ``ordinal`` now holds ``keys`` (the fleet's ``version``-th update)."""
    change = routing_pb2.ResidencyChange(ordinal=ordinal, added=keys)
    delta = routing_pb2.Delta(residency=[change])
    fleet.apply(routing_pb2.StateUpdate(epoch=1, version=version, delta=delta))


def _sentence(rng: random.Random, vocabulary: list[str]) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(rng.randint(6, 16))) + ".\n"
