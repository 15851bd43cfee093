"""The named runs of ``kvroute bench sim``: a workload, a fleet, and the contenders.

Each scenario states its regime (how the caches compare with the working set, how many
router instances) because the regime decides who can win: where every prefix fits every
replica and one router sees all traffic, an approximate tree already reaches the oracle.
``quick`` shrinks every scenario so that the whole set runs in seconds (CI).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.sim.contenders import DEFAULT, KVROUTE, PEERS
from bench.sim.engine import EngineShape
from bench.sim.lora import AdapterTraffic
from bench.sim.simulator import SimConfig
from bench.sim.workloads import (
    MooncakeTrace,
    MultiTurn,
    NoReuse,
    PrefixClients,
    Rag,
    SharedPrefix,
    Workload,
)

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"  # beside the project
DEFAULT_TRACE = SHARED_DATA / "mooncake_conversation_trace.jsonl"
DEFAULT_SHAREGPT = SHARED_DATA / "sharegpt_v3_partial_turn_lengths.jsonl"
LINEUP = (*KVROUTE, "kv_cost:locality_weight=0.5", *PEERS)  # 0.5: the plain predicted TTFT
# P/D (bench/sim/pd.py): kvroute's pairs, decode residency ignored, round-robin prefill, smg's
# PD router; then the same replicas colocated
# LoRA adapters (bench/sim/lora.py): kvroute's adapter rule, loading on every miss, round-robin
LORA_LINEUP = ("lora:kv_cost", "lora-miss:kv_cost", "lora-miss:round_robin")
PD_LINEUP = (
    "pd:kv_cost", "pd-load:kv_cost", "pd:kv_aware", "pd:round_robin", "smg-pd:cache_aware",
    "kv_aware", "kv_cost",
)  # fmt: skip


@dataclass(frozen=True)
class Inputs:
    """What the command line passes to every scenario."""

    quick: bool = False
    trace: Path = DEFAULT_TRACE
    data: Path = DEFAULT_SHAREGPT
    requests: int | None = None  # overrides a scenario's request count where it has one
    seed: int = 1
    compression: float = 3.0  # the Mooncake trace's arrival times divided by this


@dataclass(frozen=True)
class Scenario:
    name: str
    regime: str
    config: SimConfig
    workload: Callable[[Inputs], Workload | None]  # None: its input file is missing
    policies: tuple[str, ...] = LINEUP
    goals: tuple[str, ...] = field(default=())
    in_default_run: bool = True  # False: only when named with --scenario


def _shape(num_blocks: int, max_num_seqs: int = 64) -> EngineShape:
    return EngineShape(num_blocks=num_blocks, max_num_seqs=max_num_seqs)


def _shared_prefix(inputs: Inputs) -> Workload:
    if inputs.quick:
        return SharedPrefix(groups=16, prompts_per_group=8, rate=12.0, seed=inputs.seed)
    per_group = (inputs.requests or 1024) // 64
    return SharedPrefix(prompts_per_group=max(per_group, 1), rate=30.0, seed=inputs.seed)


def _one_system_prompt(inputs: Inputs) -> Workload:
    if inputs.quick:
        return SharedPrefix(groups=1, prompts_per_group=160, rate=24.0, seed=inputs.seed)
    count = inputs.requests or 1024
    return SharedPrefix(
        groups=1, prompts_per_group=count, rate=24.0, seed=inputs.seed, name="one_system_prompt"
    )


def _shared_prefix_llmd(inputs: Inputs) -> Workload:
    groups, per_group = (30, 5) if inputs.quick else (150, 5)
    return SharedPrefix(
        groups=groups,
        prompts_per_group=per_group,
        system_tokens=6000,
        question_tokens=1200,
        output_tokens=1000,
        rate=6.0,
        seed=inputs.seed,
        name="shared_prefix_llmd",
    )


def _e2e_shared_prefix(inputs: Inputs) -> Workload:
    return PrefixClients(seed=inputs.seed)


def _multi_turn(inputs: Inputs) -> Workload:
    sessions = 60 if inputs.quick else (inputs.requests or 3000) // 3
    return MultiTurn(sessions=sessions, rate=4.0, data=inputs.data, seed=inputs.seed)


def _slow_chats(inputs: Inputs) -> Workload:
    sessions = 60 if inputs.quick else (inputs.requests or 1000) // 3
    return MultiTurn(sessions=sessions, rate=1.0, data=inputs.data, seed=inputs.seed)


def _rag(inputs: Inputs) -> Workload:
    requests = 300 if inputs.quick else inputs.requests or 5000
    return Rag(requests=requests, rate=25.0, seed=inputs.seed)


def _speed(inputs: Inputs) -> Workload:
    if inputs.quick:
        return SharedPrefix(groups=64, prompts_per_group=16, rate=200.0, seed=inputs.seed)
    per_group = (inputs.requests or 100_032) // 64
    return SharedPrefix(prompts_per_group=per_group, rate=200.0, seed=inputs.seed, name="speed")


def _no_reuse(inputs: Inputs) -> Workload:
    requests = 300 if inputs.quick else inputs.requests or 5000
    return NoReuse(requests=requests, rate=40.0, seed=inputs.seed)


def _adapters(inputs: Inputs, rate: float = 80.0) -> Workload:
    count = 600 if inputs.quick else inputs.requests or 3000
    return AdapterTraffic(requests=count, rate=rate, seed=inputs.seed)


def _adapters_heavy(inputs: Inputs) -> Workload:
    return _adapters(inputs, rate=160.0)


def _mooncake(inputs: Inputs) -> Workload | None:
    if not inputs.trace.exists():
        return None
    limit = 1500 if inputs.quick else inputs.requests
    return MooncakeTrace(path=inputs.trace, speedup=inputs.compression, limit=limit)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "shared_prefix",
            "SGLang's generated-shared-prefix defaults (64 groups x 16, 2048/128/256), "
            "8 replicas of 4,096 blocks: all prefixes are 2x one replica's cache; "
            "one router instance",
            SimConfig(replicas=8, shape=_shape(4096)),
            _shared_prefix,
            goals=("hit_vs_oracle", "ahead_of_sglang", "kv_beats_rr"),
        ),
        Scenario(
            "shared_prefix_4_routers",
            "the same stream through 4 router instances behind a round-robin L4 balancer "
            "(each peer instance learns its own tree; kvroute's share one residency map)",
            SimConfig(replicas=8, shape=_shape(4096), router_instances=4),
            _shared_prefix,
        ),
        Scenario(
            "e2e_shared_prefix",
            "kvroute bench e2e's shared-prefix run as its clients send it: 16 groups x 16 "
            "prompts (2,000-token system prompt, 80-token question, 8 out), 8 clients each "
            "on one keep-alive connection sending its next prompt when its last answered, "
            "onto 4 replicas of 768 blocks (its kvroute-sim engines); --routers N puts N "
            "routers behind the balancer (issue 39's target: at 8, 98% of one's hit rate)",
            SimConfig(replicas=4, shape=_shape(768, max_num_seqs=256)),
            _e2e_shared_prefix,
            policies=("round_robin", "kv_aware", "kv_cost"),
            in_default_run=False,
        ),
        Scenario(
            "shared_prefix_llmd",
            "llm-d's benchmark shape (150 groups x 5, 6000/1200/1000), 8 replicas of "
            "8,192 blocks (prefixes 3.4x one replica's cache)",
            SimConfig(replicas=8, shape=_shape(8192)),
            _shared_prefix_llmd,
        ),
        Scenario(
            "multi_turn",
            "chat sessions with ShareGPT turn lengths (synthetic when the file is absent), "
            "closed loop, 16 replicas of 8,192 blocks",
            SimConfig(replicas=16, shape=_shape(8192)),
            _multi_turn,
        ),
        Scenario(
            "rag",
            "RAG: 512-token system prompt + 3 of 1,000 documents (Zipf s=1.1, 1,024 tokens "
            "each) + question, 8 replicas of 4,096 blocks",
            SimConfig(replicas=8, shape=_shape(4096)),
            _rag,
            goals=("ahead_of_peers",),
        ),
        Scenario(
            "mooncake",
            "Mooncake conversation trace, time compressed 3x (--compression), 16 replicas of "
            "65,536 blocks (1M tokens each, as with Mooncake's DRAM pool)",
            SimConfig(replicas=16, shape=_shape(65536)),
            _mooncake,
            policies=(*KVROUTE, "kv_cost:locality_weight=0.5", *PEERS),
            goals=("mooncake_ttft", "ahead_of_peers"),
        ),
        Scenario(
            "mooncake_100ms_load",
            "the Mooncake run with engine load sampled every 100 ms instead of 500 ms "
            "(a faster sidecar heartbeat)",
            SimConfig(replicas=16, shape=_shape(65536), load_period_s=0.1),
            _mooncake,
            policies=(*KVROUTE, *PEERS),
            goals=("mooncake_ttft", "ahead_of_peers"),
        ),
        Scenario(
            "shared_prefix_100ms_load",
            "the shared-prefix run with engine load sampled every 100 ms instead of 500 ms",
            SimConfig(replicas=8, shape=_shape(4096), load_period_s=0.1),
            _shared_prefix,
            policies=("round_robin", "least_load", "kv_aware", "kv_cost", "sglang:cache_aware"),
            goals=("hit_vs_oracle", "ahead_of_sglang", "kv_beats_rr"),
        ),
        Scenario(
            "one_system_prompt",
            "one app: every request is one 2,048-token system prompt and its own 128-token "
            "question (256 out), 24/s onto 8 replicas of 4,096 blocks and 256 seats, so a "
            "replica takes far more than max_imbalance requests before its queue saturates",
            SimConfig(replicas=8, shape=_shape(4096, max_num_seqs=256)),
            _one_system_prompt,
            policies=(
                "round_robin",
                "least_load",
                "kv_aware",
                "kv_aware:hot_prefix_gap=null",  # max_imbalance (64) alone
                "kv_aware:hot_prefix_gap=null,max_imbalance=16",  # tighter than 64
                "kv_aware:hot_prefix_gap=null,max_imbalance=1000000",  # the score alone
                "kv_cost",
                "kv_cost:hot_prefix_gap=null",  # the score alone
                "sglang:cache_aware",
            ),
        ),
        Scenario(
            "pd_shared_prefix",
            "the shared-prefix stream onto 8 replicas of 4,096 blocks: P/D contenders 4 "
            "prefill + 4 decode (KV read at 0.05 ms a block), colocated ones all 8",
            SimConfig(replicas=8, shape=_shape(4096), prefill_replicas=4),
            _shared_prefix,
            policies=PD_LINEUP,
            goals=("pd_beats_rr", "pd_ahead_of_smg"),
            in_default_run=False,
        ),
        Scenario(
            "pd_mooncake",
            "the Mooncake trace (compressed 3x: 9.2 requests/s of 13,300 tokens in, 350 "
            "out, so prefill-heavy) onto 16 replicas of 65,536 blocks: P/D contenders 12 "
            "prefill + 4 decode (KV read at 0.05 ms a block), colocated all 16",
            SimConfig(replicas=16, shape=_shape(65536), prefill_replicas=12),
            _mooncake,
            policies=PD_LINEUP,
            goals=("pd_beats_rr", "pd_ahead_of_smg"),
            in_default_run=False,
        ),
        Scenario(
            "adapters",
            "16 LoRA adapters over 8 replicas of 2,048 blocks, Zipf(1.1) popularity, 80/s: "
            "each prompt its adapter's 1,024-token prefix (keyed under the adapter) and a "
            "96-token question (32 out); a replica keeps 4 adapters loaded (adapter a starts "
            "on replica a mod 8), loading one takes 0.5 s and unloads the least recently used",
            SimConfig(replicas=8, shape=_shape(2048)),
            _adapters,
            policies=LORA_LINEUP,
            goals=("lora_beats",),
            in_default_run=False,
        ),
        Scenario(
            "adapters_heavy",
            "the adapters scenario at 160/s: the popular adapters' holders saturate",
            SimConfig(replicas=8, shape=_shape(2048)),
            _adapters_heavy,
            policies=LORA_LINEUP,
            goals=("lora_beats",),
            in_default_run=False,
        ),
        Scenario(
            "slow_replica",
            "chat sessions with ShareGPT turn lengths, closed loop, onto 4 replicas of 8,192 "
            "blocks, one of them ten times slower in every step (prefill at 1,000 tokens/s, "
            "decode steps 10x as long: a smaller GPU or a larger model): its fair share of "
            "the work is 1/31",
            SimConfig(replicas=4, shape=_shape(8192), slowdown=((3, 10.0),)),
            _slow_chats,
            policies=(*KVROUTE, "sglang:cache_aware", "llm-d:precise", "dynamo:kv"),
            goals=("slow_share",),
        ),
        Scenario(
            "no_reuse",
            "unique 1,024-token prompts (negative control), 8 replicas of 4,096 blocks",
            SimConfig(replicas=8, shape=_shape(4096)),
            _no_reuse,
            goals=("no_reuse",),
        ),
        Scenario(
            "speed",
            "simulator speed: shared prefix (64 groups, 2048/128/256), 100,032 requests at "
            "200/s on 64 replicas of 8,192 blocks, kv_aware; target: under 60 s of wall time",
            SimConfig(replicas=64, shape=_shape(8192)),
            _speed,
            policies=("kv_aware",),
            goals=("speed",),
            in_default_run=False,
        ),
    )
}

QUICK_POLICIES = ("round_robin", DEFAULT)
QUICK_PD_POLICIES = ("pd:round_robin", f"pd:{DEFAULT}", "smg-pd:cache_aware", DEFAULT)


def quick(scenario: Scenario) -> Scenario:
    """The CI-sized version: kvroute's round_robin and the default only (P/D: the pairs of
    each, smg's and the default colocated), at most 4 replicas (P/D: 2 + 2)."""
    config = scenario.config
    pd = config.prefill_replicas > 0
    config = replace(config, replicas=min(config.replicas, 4), prefill_replicas=2 if pd else 0)
    if scenario.policies == LORA_LINEUP:  # its contenders need its workload and slots
        return replace(scenario, config=config)
    return replace(scenario, config=config, policies=QUICK_PD_POLICIES if pd else QUICK_POLICIES)
