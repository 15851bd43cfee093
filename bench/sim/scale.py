"""Scale mode: how one routing decision and the residency map grow with the fleet.

Measured on the real code (``kvcore.policies`` over a ``BitmaskResidencyIndex``, the fleet
on a ``ReplicaBoard`` as the simulator's routers keep it), outside the event loop, as
wall-clock medians (the lowest of three rounds, each round visiting every case):

1. decision time against fleet size (8 ... 512 replicas) at a fixed prompt (128 blocks,
   2,048 tokens), a quarter, half, three quarters and all of it resident on four replicas,
   loads random;
2. decision time against prompt length (32 ... 2,048 blocks) at 64 replicas;
3. decision time on prompts never routed before (a new prompt per decision, so no index
   reads one from a beginning it remembers), over each residency index;
4. each index's memory (RSS growth), batch add rate and decision time as it grows to
   10M keys (each key held by 1-2 of 64 replicas).

Goals: decision time flat in fleet size (within 2x from 8 to 512 replicas), linear in
prompt blocks (a straight-line fit explains >= 95% of the variance), a 2,048-block
decision within 0.25 ms for every kv strategy, and at most 48 bytes a resident key at
10M keys in the compact index (the control plane's; a proxy's when it chooses it).
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcore.index import INDEXES, ResidencyIndex
from kvcore.policies import ReplicaState, RouteContext, StaticStateView, create_policy
from kvcore.workload import parse_workload

MODEL = "sim-model"
STRATEGIES = ("round_robin", "kv_aware", "kv_cost")
FLEETS = (8, 32, 64, 128, 256, 512)
PROMPTS = (32, 128, 512, 2048)
KV_STRATEGIES = ("kv_aware", "kv_cost")
MAX_DECISION_US = 250.0  # a 2,048-block prompt, every kv strategy
MAX_BYTES_PER_KEY = 48.0  # the compact index at 10M keys


@dataclass
class ScaleResult:
    fleet: list[dict[str, Any]] = field(default_factory=list)  # replicas, strategy, us
    prompt: list[dict[str, Any]] = field(default_factory=list)  # blocks, strategy, us
    map_size: list[dict[str, Any]] = field(default_factory=list)  # index, keys, MB, B/key, us
    new_prompts: list[dict[str, Any]] = field(default_factory=list)  # index, blocks, strategy
    goals: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "prompt": self.prompt,
            "map_size": self.map_size,
            "new_prompts": self.new_prompts,
            "goals": self.goals,
        }

    def markdown(self) -> list[str]:
        lines = [
            "## scale",
            "",
            "| replicas | " + " | ".join(STRATEGIES) + " |",
            "|---|" + "---|" * len(STRATEGIES),
        ]
        lines += _rows(self.fleet, "replicas")
        lines += [
            "",
            "| prompt blocks (64 replicas) | " + " | ".join(STRATEGIES) + " |",
            "|---|" + "---|" * len(STRATEGIES),
        ]
        lines += _rows(self.prompt, "blocks")
        lines += [
            "",
            "| new prompt each decision (64 replicas) | " + " | ".join(KV_STRATEGIES) + " |",
            "|---|" + "---|" * len(KV_STRATEGIES),
        ]
        for name in INDEXES:
            for blocks in sorted({r["blocks"] for r in self.new_prompts}):
                cells = [
                    f"{r['us']:.0f} us"
                    for s in KV_STRATEGIES
                    for r in self.new_prompts
                    if (r["index"], r["blocks"], r["strategy"]) == (name, blocks, s)
                ]
                lines.append(f"| {name}, {blocks} blocks | " + " | ".join(cells) + " |")
        lines += [
            "",
            "| index | residency keys | RSS growth | bytes/key | batch add | kv_aware decision |",
            "|---|---|---|---|---|---|",
        ]
        for row in self.map_size:
            lines.append(
                f"| {row['index']} | {row['keys']:,} | {row['rss_mb']:.0f} MB | "
                f"{row['bytes_per_key']:.0f} | {row['add_keys_per_s'] / 1e6:.2f}M keys/s | "
                f"{row['kv_aware_us']:.0f} us |"
            )
        lines += ["", *(f"- {g['verdict']}: {g['goal']} ({g['detail']})" for g in self.goals), ""]
        return lines

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (by_fleet, by_prompt) = plt.subplots(1, 2, figsize=(11, 4))
        for strategy in STRATEGIES:
            rows = [r for r in self.fleet if r["strategy"] == strategy]
            by_fleet.plot(
                [r["replicas"] for r in rows], [r["us"] for r in rows], "o-", label=strategy
            )
            rows = [r for r in self.prompt if r["strategy"] == strategy]
            by_prompt.plot(
                [r["blocks"] for r in rows], [r["us"] for r in rows], "o-", label=strategy
            )
        by_fleet.set(
            xscale="log",
            yscale="log",
            title="decision time vs fleet size (128 blocks)",
            xlabel="replicas",
            ylabel="us per decision",
        )
        by_prompt.set(
            xscale="log",
            yscale="log",
            title="decision time vs prompt (64 replicas)",
            xlabel="prompt blocks",
            ylabel="us per decision",
        )
        by_fleet.legend()
        by_prompt.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=60)
        plt.close(fig)


def _rows(rows: list[dict[str, Any]], key: str) -> list[str]:
    values = sorted({r[key] for r in rows})
    out = []
    for value in values:
        cells = [
            next((f"{r['us']:.0f} us" for r in rows if r[key] == value and r["strategy"] == s), "")
            for s in STRATEGIES
        ]
        out.append(f"| {value} | " + " | ".join(cells) + " |")
    return out


def _view(
    replicas: int, keys: Sequence[int], rng: random.Random, index: ResidencyIndex | None = None
) -> StaticStateView:
    states = [
        ReplicaState(
            i,
            f"replica-{i}",
            running=rng.randrange(48),
            waiting=rng.randrange(4),
            kv_usage=rng.random() * 0.8,
            capacity=64,
        )
        for i in range(replicas)
    ]
    view = StaticStateView(states, index)
    # four holders of a quarter, half, three quarters and all of the prompt, whatever the
    # fleet: a decision's cost follows the longest run, so every fleet gets the same runs
    for quarter, holder in enumerate(rng.sample(range(replicas), min(4, replicas)), 1):
        view.index.add(holder, keys[: len(keys) * quarter // 4])
    return view


def decision_us(strategy: str, view: StaticStateView, keys: Sequence[int], repeat: int) -> float:
    """Median wall time of one ``select`` in microseconds."""
    fields: dict[str, Any] = {"strategy": strategy}
    if strategy.startswith("kv"):
        fields["speculative_ttl_s"] = 0  # keep the index unchanged between repeats
    workload = parse_workload(fields)
    policy = create_policy(workload, rng=random.Random(1))
    ctx = RouteContext(workload, MODEL, keys, now=1.0)
    samples = []
    for _ in range(repeat):
        started = time.perf_counter_ns()
        policy.select(ctx, view)
        samples.append((time.perf_counter_ns() - started) / 1000)
    return statistics.median(samples)


def _prompt(blocks: int, rng: random.Random) -> list[int]:
    return [rng.getrandbits(64) for _ in range(blocks)]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(*, quick: bool = False) -> ScaleResult:
    rng = random.Random(7)
    result = ScaleResult()
    repeat, rounds = (60, 1) if quick else (300, 3)
    keys = _prompt(128, rng)
    fleets = [(n, _view(n, keys, rng), keys) for n in ((8, 64) if quick else FLEETS)]
    prompts = []
    for blocks in (32, 128) if quick else PROMPTS:
        prompt = _prompt(blocks, rng)
        prompts.append((blocks, _view(64, prompt, rng), prompt))
    for (replicas, strategy), us in _lowest_of_rounds(fleets, repeat, rounds).items():
        result.fleet.append({"replicas": replicas, "strategy": strategy, "us": us})
    for (blocks, strategy), us in _lowest_of_rounds(prompts, repeat, rounds).items():
        result.prompt.append({"blocks": blocks, "strategy": strategy, "us": us})
    result.new_prompts = _new_prompts((128,) if quick else (512, 2048), 20 if quick else 200)
    result.map_size = _map_growth((10_000, 100_000) if quick else (100_000, 1_000_000, 10_000_000))
    result.goals = _goals(result)
    return result


def _lowest_of_rounds(
    cases: Sequence[tuple[int, StaticStateView, Sequence[int]]], repeat: int, rounds: int
) -> dict[tuple[int, str], float]:
    """Each (case, strategy)'s median decision time, the lowest of ``rounds`` rounds that
    each visit every case in turn: a burst of load on a shared machine then stretches one
    round of every case rather than every round of one, so sizes compare side by side."""
    lowest: dict[tuple[int, str], float] = {}
    for _ in range(rounds):
        for size, view, keys in cases:
            for strategy in STRATEGIES:
                us = decision_us(strategy, view, keys, repeat)
                lowest[size, strategy] = min(us, lowest.get((size, strategy), math.inf))
    return lowest


def _new_prompts(lengths: Sequence[int], count: int) -> list[dict[str, Any]]:
    """Median decision time over ``count`` prompts each routed once, per index."""
    rows = []
    for name, make in INDEXES.items():
        rng = random.Random(13)
        for blocks in lengths:
            prompts = [_prompt(blocks, rng) for _ in range(count)]
            view = _view(64, prompts[0], rng, make())
            for prompt in prompts[1:]:
                for quarter, holder in enumerate(rng.sample(range(64), 4), 1):
                    view.index.add(holder, prompt[: blocks * quarter // 4])
            for strategy in KV_STRATEGIES:
                us = _each_once_us(strategy, view, prompts)
                rows.append({"index": name, "blocks": blocks, "strategy": strategy, "us": us})
    return rows


def _each_once_us(strategy: str, view: StaticStateView, prompts: Sequence[Sequence[int]]) -> float:
    workload = parse_workload({"strategy": strategy, "speculative_ttl_s": 0})
    policy = create_policy(workload, rng=random.Random(1))
    samples = []
    for keys in prompts:
        ctx = RouteContext(workload, MODEL, keys, now=1.0)
        started = time.perf_counter_ns()
        policy.select(ctx, view)
        samples.append((time.perf_counter_ns() - started) / 1000)
    return statistics.median(samples)


def _map_growth(sizes: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for name, make in INDEXES.items():
        rng = random.Random(11)
        prompt = _prompt(128, rng)
        for size in sizes:
            rows.append({"index": name, "keys": size, **_grown(make(), size, prompt, rng)})
    return rows


def _grown(
    index: ResidencyIndex, size: int, prompt: list[int], rng: random.Random
) -> dict[str, float]:
    """``index`` filled to ``size`` keys: its RSS growth, add rate and a decision's time."""
    gc.collect()
    before = _rss_mb()
    batch, adding = 100_000, 0.0
    for start in range(0, size, batch):
        chunk = [rng.getrandbits(64) for _ in range(min(batch, size - start))]
        started = time.perf_counter()
        index.add(rng.randrange(64), chunk)
        index.add(rng.randrange(64), chunk[: len(chunk) // 2])
        adding += time.perf_counter() - started
    del chunk
    gc.collect()
    grown = _rss_mb() - before
    view = _view(64, prompt, rng, index)
    for holder in range(4):
        index.add(holder, prompt[: 32 * (holder + 1)])
    return {
        "rss_mb": grown,
        "bytes_per_key": grown * 2**20 / size,
        "add_keys_per_s": size * 1.5 / adding,
        "kv_aware_us": decision_us("kv_aware", view, prompt, 200),
    }


def _goals(result: ScaleResult) -> list[dict[str, Any]]:
    goals = _size_goals(result)
    for strategy in ("kv_aware", "kv_cost"):
        rows = sorted(
            (r for r in result.fleet if r["strategy"] == strategy), key=lambda r: r["replicas"]
        )
        growth = rows[-1]["us"] / rows[0]["us"]
        goals.append(
            {
                "goal": f"{strategy} decision time within 2x from {rows[0]['replicas']} to "
                f"{rows[-1]['replicas']} replicas",
                "verdict": "met" if growth <= 2 else "MISSED",
                "detail": f"{rows[0]['us']:.0f} us -> {rows[-1]['us']:.0f} us ({growth:.1f}x)",
            }
        )
        rows = [r for r in result.prompt if r["strategy"] == strategy]
        r2, slope = _linear_fit([r["blocks"] for r in rows], [r["us"] for r in rows])
        goals.append(
            {
                "goal": f"{strategy} decision time linear in prompt blocks (R^2 >= 0.95)",
                "verdict": "met" if r2 >= 0.95 else "MISSED",
                "detail": f"R^2 {r2:.3f}, {slope:.2f} us per block",
            }
        )
    return goals


def _linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(R^2, slope) of the least-squares line through the points."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx if sxx else 0.0
    ss_res = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - mean_y) ** 2 for y in ys)
    return (1 - ss_res / ss_tot if ss_tot else 1.0), slope


def _size_goals(result: ScaleResult) -> list[dict[str, Any]]:
    """The long-prompt and memory goals, where the run measured them."""
    goals = []
    longest = max(r["blocks"] for r in result.prompt)
    if longest >= 2048:
        slowest = max(
            (r for r in result.prompt if r["blocks"] == longest and r["strategy"] in KV_STRATEGIES),
            key=lambda r: r["us"],
        )
        goals.append(
            {
                "goal": f"a {longest}-block decision within {MAX_DECISION_US:.0f} us, every kv "
                "strategy",
                "verdict": "met" if slowest["us"] <= MAX_DECISION_US else "MISSED",
                "detail": f"slowest {slowest['strategy']} {slowest['us']:.0f} us",
            }
        )
    for name in INDEXES:
        rows = [r for r in result.new_prompts if r["index"] == name and r["blocks"] >= 2048]
        if rows:
            slowest = max(rows, key=lambda r: r["us"])
            goals.append(
                {
                    "goal": f"a new {slowest['blocks']}-block prompt's decision over the {name} "
                    f"index within {MAX_DECISION_US:.0f} us, every kv strategy",
                    "verdict": "met" if slowest["us"] <= MAX_DECISION_US else "MISSED",
                    "detail": f"slowest {slowest['strategy']} {slowest['us']:.0f} us",
                }
            )
    compact = [r for r in result.map_size if r["index"] == "compact"]
    largest = max(compact, key=lambda r: r["keys"])
    if largest["keys"] >= 10_000_000:
        goals.append(
            {
                "goal": f"compact index within {MAX_BYTES_PER_KEY:.0f} bytes a key at "
                f"{largest['keys']:,} keys",
                "verdict": "met" if largest["bytes_per_key"] <= MAX_BYTES_PER_KEY else "MISSED",
                "detail": f"{largest['bytes_per_key']:.0f} B/key ({largest['rss_mb']:.0f} MB)",
            }
        )
    return goals
