"""One routing decision per strategy: 64 replicas, a 512-block prompt (8,192 tokens);
and the proxy's load accounting around it (``InflightLedger``)."""

from __future__ import annotations

import random

from bench.micro.report import Figure, median_us
from kvcore.keys import block_keys
from kvcore.policies import (
    InflightLedger,
    ReplicaState,
    RouteContext,
    StaticStateView,
    create_policy,
)
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
    explained = _decision_figure("kv_aware", keys, tokens, view, explain=True)
    return [*figures, explained, _ledger_figure(rng)]


def _ledger_figure(rng: random.Random) -> Figure:
    """Per request: one send, one end, and every replica's unreported count, with 32
    requests in flight per replica and a load report every 50 requests."""
    ledger = InflightLedger()
    live = [(i % REPLICAS, ledger.sent(i % REPLICAS, 0.0)) for i in range(32 * REPLICAS)]
    clock = [1.0]

    def request() -> None:
        clock[0] += 0.001
        now = clock[0]
        report_ts = now - 0.05
        _counts = [ledger.unreported(r, report_ts) for r in range(REPLICAS)]
        replica = rng.randrange(REPLICAS)
        live.append((replica, ledger.sent(replica, now)))
        index = rng.randrange(len(live))
        live[index], live[-1] = live[-1], live[index]
        ledger.done(*live.pop())

    us = median_us(request, repeat=2000)
    return Figure(f"load accounting per request, {REPLICAS} replicas (InflightLedger)", us, "us")


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
