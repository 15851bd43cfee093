"""The proxy benchmark's verdicts: each figure beside its target, ratios between routers.

Pure code (no processes, no clock), so that what counts as met, missed or not run is
tested on its own. A target is an upper bound (a latency) or a lower bound (a
throughput ratio); a figure that needs a router which did not run is ``NOT RUN`` with the
reason, never left out and never counted as met.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.micro.report import Figure

ADDED_LATENCY_MS = 0.3  # kvroute's added latency, p50
LATENCY_VS_SGLANG = 1.0  # kvroute's added latency / sglang-router's, at most
THROUGHPUT_VS_SGLANG = 0.9  # kvroute's throughput / sglang-router's, at least
CEILING_SHARE = 0.9  # a router this close to the replicas' own throughput is not the limit
IDLE_NOTE = 0.02  # the idle routers' CPU share worth a note beside a router's throughput

# the strategy of the default workload, what the proxy of ``kvroute up`` routes with
FLEET_STRATEGY = "kv_cost"
# the strategies ``--fleet-strategy`` may set on the fleet's default workload instead
FLEET_STRATEGIES = (FLEET_STRATEGY, "kv_aware")


def pairs(fleet_strategy: str = FLEET_STRATEGY) -> tuple[tuple[str, str], ...]:
    """(kvroute's contender, the peer policy it is judged against): like for like."""
    return (("round_robin", "round_robin"), (fleet_strategy, "cache_aware"))


JUDGE = "sglang-router"  # the peer the targets name
PEERS = ("sglang-router", "vllm-router", "smg")  # bench.e2e.peers, in its order


def floor_name(label: str) -> str:
    """The name of a ``bench.passthrough`` floor, which sends to replica 0 only."""
    return f"pass-through floor, {label} (one replica)"


# the floor every run measures: what one more hop on loopback costs here, before any work
HOP = floor_name("byte relay, no HTTP (the hop itself)")


@dataclass
class Measured:
    """One router's figures from one run (``unavailable``: why it did not run)."""

    name: str  # "kvroute kv_cost", "sglang-router cache_aware", ...
    added_ms: float | None = None  # p50 over calling a replica directly
    rps: float | None = None
    cpu_share: float | None = None  # of one core, while under the throughput load
    errors: int = 0
    unavailable: str = ""
    idle_routers_share: float | None = None  # the other routers' CPU while this one ran
    helpers_share: float | None = None  # the fleet's CPU beside the replicas meanwhile
    # the same load with the router under a CPU limit (``Results.cpu_limit``)
    limited_rps: float | None = None
    limited_share: float | None = None
    limited_errors: int = 0
    limited_throttled: int = 0  # periods in which the limit stalled the router
    awake_added_ms: float | None = None  # added_ms with its CPU kept from idling (--awake)

    @property
    def per_cpu_second(self) -> float | None:
        """Requests per CPU-second the router spent: what a core buys, even when other
        work on a shared machine kept the router from a whole core."""
        return _ratio(self.rps, self.cpu_share)


@dataclass(frozen=True)
class Row:
    """One printed figure: ``value`` None when it could not be measured (``note`` says why)."""

    name: str
    value: float | None
    unit: str
    target: float | None = None
    at_least: bool = False  # the target is a lower bound
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "not run" if self.value is None else ""
        if self.value is None:
            return "NOT RUN"
        met = self.value >= self.target if self.at_least else self.value <= self.target
        return "met" if met else "MISSED"

    @classmethod
    def of(cls, figure: Figure) -> Row:
        return cls(figure.name, figure.value, figure.unit, figure.target)


@dataclass
class Results:
    direct_ms: float | None = None  # p50 of one request per replica per round, pooled
    direct_each_ms: list[float] = field(default_factory=list)  # p50 per replica
    direct_rps: float | None = None
    routers: dict[str, Measured] = field(default_factory=dict)
    cpu_limit: str = ""  # the limited runs' limit, as a pod spec writes it ("400m")
    limit_unavailable: str = ""  # why there were no limited runs
    awake_direct_ms: float | None = None  # direct_ms in the rounds kept awake (--awake)
    fleet_strategy: str = FLEET_STRATEGY  # the fleet proxy's (--fleet-strategy)

    def get(self, name: str) -> Measured:
        return self.routers.get(name) or Measured(name, unavailable="not started")


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs <= 0:
        return None
    return ours / theirs


def _why(*measured: Measured) -> str:
    return "; ".join(f"{m.name}: {m.unavailable}" for m in measured if m.unavailable)


def latency_rows(results: Results) -> list[Row]:
    """Added latency of every router, grouped like for like, with kvroute's ratios."""
    rows = [Row("one client, short prompt: direct to the replicas, each in turn (p50)",
                results.direct_ms, "ms")]  # fmt: skip
    rows += [
        Row(f"  direct to replica {i} alone (p50)", ms, "ms")
        for i, ms in enumerate(results.direct_each_ms)
    ]
    hop = results.routers.get(HOP)
    if hop is not None:
        rows.append(
            Row("  added latency p50, the hop alone (a byte relay to replica 0, no HTTP: the "
                "floor of any proxy here)", hop.added_ms, "ms", note=_why(hop))
        )  # fmt: skip
    for ours, theirs in pairs(results.fleet_strategy):
        kvroute = results.get(f"kvroute {ours}")
        rows.append(
            Row(f"added latency p50, {kvroute.name}", kvroute.added_ms, "ms", ADDED_LATENCY_MS,
                note=_why(kvroute))
        )  # fmt: skip
        for peer in PEERS:
            other = results.get(f"{peer} {theirs}")
            rows.append(Row(f"added latency p50, {other.name}", other.added_ms, "ms",
                            note=_why(other)))  # fmt: skip
        for peer in PEERS:
            other = results.get(f"{peer} {theirs}")
            target = LATENCY_VS_SGLANG if peer == JUDGE else None
            rows.append(
                Row(f"  {kvroute.name} / {other.name}", _ratio(kvroute.added_ms, other.added_ms),
                    "x", target, note=_why(kvroute, other))
            )  # fmt: skip
    return rows


def throughput_rows(results: Results, concurrency: int) -> list[Row]:
    """Requests per second of every router on the same CPU budget, with kvroute's ratios."""
    rows = [
        Row(f"throughput at concurrency {concurrency}, direct to the replicas (their ceiling)",
            results.direct_rps, "req/s")
    ]  # fmt: skip
    for ours, theirs in pairs(results.fleet_strategy):
        kvroute = results.get(f"kvroute {ours}")
        rows.append(_throughput_row(kvroute, results.direct_rps))
        for peer in PEERS:
            rows.append(_throughput_row(results.get(f"{peer} {theirs}"), results.direct_rps))
        for peer in PEERS:
            other = results.get(f"{peer} {theirs}")
            target = THROUGHPUT_VS_SGLANG if peer == JUDGE else None
            rows.append(
                Row(f"  {kvroute.name} / {other.name}", _ratio(kvroute.rps, other.rps), "x",
                    target, at_least=True, note=_why(kvroute, other))
            )  # fmt: skip
            rows.append(
                Row(f"    {kvroute.name} / {other.name}, per router CPU-second",
                    _ratio(kvroute.per_cpu_second, other.per_cpu_second), "x",
                    note=_why(kvroute, other))
            )  # fmt: skip
    return rows


def limited_rows(results: Results, concurrency: int) -> list[Row]:
    """Requests per second with each router under the same CPU limit, so that the router
    bounds them (unlimited, the replicas and the load generator sharing the other CPU
    do): the same targets as :func:`throughput_rows`. None when no limit was asked for."""
    label, why = results.cpu_limit, results.limit_unavailable
    if not label and not why:
        return []
    under = f"under a CPU limit of {label}" if label else "under a CPU limit"
    rows = []
    for ours, theirs in pairs(results.fleet_strategy):
        kvroute = results.get(f"kvroute {ours}")
        rows.append(_limited_row(kvroute, under, why))
        for peer in PEERS:
            rows.append(_limited_row(results.get(f"{peer} {theirs}"), under, why))
        for peer in PEERS:
            other = results.get(f"{peer} {theirs}")
            target = THROUGHPUT_VS_SGLANG if peer == JUDGE else None
            rows.append(
                Row(f"  {kvroute.name} / {other.name}, {under}",
                    _ratio(kvroute.limited_rps, other.limited_rps), "x", target,
                    at_least=True, note=why or _why(kvroute, other))
            )  # fmt: skip
    return rows


def _limited_row(measured: Measured, under: str, why: str) -> Row:
    notes = []
    if measured.limited_share is not None:
        notes.append(
            f"router used {measured.limited_share:.0%} of a core, stalled by the limit in "
            f"{measured.limited_throttled} periods"
        )
    if measured.limited_errors:
        notes.append(f"{measured.limited_errors} errors")
    if why or measured.unavailable:
        notes.append(why or measured.unavailable)
    return Row(f"throughput {under}, {measured.name}", measured.limited_rps, "req/s",
               note="; ".join(notes))  # fmt: skip


def _throughput_row(measured: Measured, ceiling: float | None) -> Row:
    notes = []
    if measured.cpu_share is not None and measured.per_cpu_second is not None:
        notes.append(
            f"router used {measured.cpu_share:.0%} of a core, "
            f"{measured.per_cpu_second:,.0f} requests per CPU-second"
        )
    if measured.idle_routers_share is not None and measured.idle_routers_share >= IDLE_NOTE:
        notes.append(f"the idle routers took {measured.idle_routers_share:.0%} of a core too")
    if measured.helpers_share is not None:
        notes.append(
            f"kvroute's fleet (control plane, NATS, etcd, sidecars: the replicas' KV events, "
            f"whoever routes) took {measured.helpers_share:.0%} of a core beside the replicas"
        )
    if measured.errors:
        notes.append(f"{measured.errors} errors")
    if measured.rps is not None and ceiling and measured.rps >= CEILING_SHARE * ceiling:
        notes.append("at the replicas' ceiling: a lower bound of this router's")
    if measured.unavailable:
        notes.append(measured.unavailable)
    return Row(f"throughput, {measured.name}", measured.rps, "req/s", note="; ".join(notes))


def awake_rows(results: Results) -> list[Row]:
    """``--awake``: the rounds with the routers' CPU kept from idling, no targets."""
    if results.awake_direct_ms is None:
        return []
    rows = [Row("with the routers' CPU kept from idling (--awake): direct to the replicas (p50)",
                results.awake_direct_ms, "ms")]  # fmt: skip
    rows += [
        Row(f"  added latency p50 kept awake, {name}", measured.awake_added_ms, "ms")
        for name, measured in results.routers.items()
        if measured.awake_added_ms is not None
    ]
    return rows


def extra_rows(results: Results, known: Iterable[str]) -> list[Row]:
    """Routers outside the pairs (``--router NAME=URL``, pass-through floors): the hop's
    latency is with the direct ones (:func:`latency_rows`), and its throughput only when
    measured (``--floors``)."""
    rows = []
    for name, measured in results.routers.items():
        if name in known:
            continue
        if name != HOP:
            rows.append(
                Row(f"added latency p50, {name}", measured.added_ms, "ms", note=_why(measured))
            )
        if name != HOP or measured.rps is not None or measured.unavailable:
            rows.append(_throughput_row(measured, results.direct_rps))
    return rows


def paired_names(fleet_strategy: str = FLEET_STRATEGY) -> list[str]:
    """Every router the pairs name, kvroute's first."""
    paired = pairs(fleet_strategy)
    names = [f"kvroute {ours}" for ours, _ in paired]
    return names + [f"{peer} {theirs}" for _, theirs in paired for peer in PEERS]


def render(rows: Iterable[Row]) -> str:
    lines = []
    for row in rows:
        lines.append(
            f"  {row.name:<80} {_value(row):>9} {row.unit:<5} {_target(row):<18} "
            f"{row.verdict:<7} {row.note}".rstrip()
        )
    return "\n".join(lines)


def _value(row: Row) -> str:
    if row.value is None:
        return "-"
    if row.unit == "req/s":
        return f"{row.value:,.0f}"
    return f"{row.value:.3f}"


def _target(row: Row) -> str:
    if row.target is None:
        return ""
    return f"(target {'>=' if row.at_least else '<='} {row.target:g} {row.unit})"


def all_met(rows: Iterable[Row]) -> bool:
    """False when a target was missed or could not be checked."""
    return all(row.verdict not in ("MISSED", "NOT RUN") for row in rows)


def write_json(
    path: Path, rows: list[Row], results: Results | None, context: dict[str, Any]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        **context,
        "results": asdict(results) if results is not None else None,
        "figures": [{**asdict(row), "verdict": row.verdict} for row in rows],
        "all_met": all_met(rows),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
