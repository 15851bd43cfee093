"""Building fleets, contexts and prompts for the policy tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.keys import block_keys
from kvcore.policies import ReplicaState, RouteContext
from kvcore.workload import Workload

MODEL = "m"


def fleet(count: int, **fields: Any) -> list[ReplicaState]:
    return [ReplicaState(i, f"r{i}", **fields) for i in range(count)]


def prompt(*segments: Sequence[int]) -> list[int]:
    return [token for segment in segments for token in segment]


def context(workload: Workload, tokens: Sequence[int] = (), **fields: Any) -> RouteContext:
    keys = block_keys(tokens, model=MODEL)
    return RouteContext(workload=workload, model=MODEL, block_keys=keys, token_ids=tokens, **fields)
