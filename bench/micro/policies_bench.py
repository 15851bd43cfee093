"""One routing decision per strategy: 64 replicas, a 512-block prompt (8,192 tokens)."""

from __future__ import annotations

import random

from bench.micro.report import Figure, median_us
from kvcore.keys import block_keys
from kvcore.policies import ReplicaState, RouteContext, StaticStateView, create_policy
from kvcore.workload import STRATEGIES, parse_workload

REPLICAS = 64
PROMPT_TOKENS = 8192
MODEL = "bench-model"


def _view(rng: random.Random, keys: list[int]) -> StaticStateView:
    replicas = [
        ReplicaState(i, f"replica-{i}", running=rng.randrange(40), waiting=rng.randrange(4))
        for i in range(REPLICAS)
    ]
    view = StaticStateView(replicas)
    for replica in range(REPLICAS):
        view.index.add(replica, keys[: rng.randrange(len(keys))])
    return view


def run() -> list[Figure]:
    rng = random.Random(9)
    tokens = [rng.randrange(128_000) for _ in range(PROMPT_TOKENS)]
    keys = block_keys(tokens, model=MODEL)
    view = _view(rng, keys)
    figures = [_decision_figure(strategy, keys, tokens, view) for strategy in STRATEGIES]
    return [*figures, _decision_figure("kv_aware", keys, tokens, view, explain=True)]


def _decision_figure(
    strategy: str, keys: list[int], tokens: list[int], view: StaticStateView, explain: bool = False
) -> Figure:
    fields: dict[str, object] = {"strategy": strategy}
    if strategy.startswith("kv"):
        fields["speculative_ttl_s"] = 0  # keep the index unchanged between repeats
    workload = parse_workload(fields)
    policy = create_policy(workload, rng=random.Random(1))
    ctx = RouteContext(workload, MODEL, keys, tokens, session_id="session-1", now=1.0)
    if explain:
        us = median_us(lambda: policy.select(ctx, view).to_dict(), repeat=200)
        return Figure(f"  same as {strategy}, explained (Decision.to_dict)", us, "us")
    us = median_us(lambda: policy.select(ctx, view), repeat=200)
    return Figure(f"select, {strategy}, {REPLICAS} replicas, 512 blocks", us, "us")
