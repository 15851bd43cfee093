"""``python -m bench.controlplane [ingest memory snapshot summary latency shards]``: each
figure beside its target (all by default). Loopback only; every part stops by itself.

Options: ``--events N`` (ingest, default 2,000,000), ``--keys N`` (memory, snapshot and
summary, default 1,000,000; the key-list snapshot only up to 2M), ``--rate N`` (latency,
default 50,000) and ``--seconds S`` (latency and shards, default 10); shards:
``--shard-rate N`` (block events/s in total over 2 then 3 shards, default 200,000),
``--sidecars N`` (default 256), ``--publishers N`` (processes playing them, default 4)
and ``--watchers N`` (watch streams per shard compared with one, default 8). Exit status
1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import replace

from bench.controlplane import inprocess, latency, shards
from kvruntime.gc_tuning import tune_gc

Row = tuple[str, str, str, bool | None]  # figure, value, target, met (None: reported)


def ingest_rows(events: int) -> list[Row]:
    tune_gc()  # as kvroute-controlplane runs
    alone = inprocess.ingest_rate(events, with_deltas=False)
    with_deltas = inprocess.ingest_rate(events, with_deltas=True)
    return [
        ("ingest into the index", f"{alone:,.0f} block events/s", ">= 200,000", alone >= 2e5),
        (
            "ingest + deltas every 25 ms",
            f"{with_deltas:,.0f} block events/s",
            ">= 200,000",
            with_deltas >= 2e5,
        ),
    ]


def memory_rows(keys: int) -> list[Row]:
    per_key, holdings = inprocess.memory_per_key(keys)
    return [
        (
            f"memory per resident key ({keys:,} keys, {holdings:,} holdings)",
            f"{per_key:.0f} B/key",
            "(reported)",
            None,
        )
    ]


def snapshot_rows(keys: int) -> list[Row]:
    built, sent, cpu, chunks = asyncio.run(inprocess.column_snapshot_times(keys))
    at_scale = keys >= 10_000_000
    rows: list[Row] = [
        (f"columns snapshot of {keys:,} keys built", f"{built:.2f} s ({chunks} chunks)", "", None),
        (
            "  built + sent over gRPC + applied by a proxy (compact index)",
            f"{cpu:.2f} s of CPU ({sent:.2f} s of wall time)",
            "<= 5 s CPU" if at_scale else "(at 10M keys)",
            cpu <= 5.0 if at_scale else None,
        ),
    ]
    if keys > 2_000_000:
        return rows
    built, sent, chunks = asyncio.run(inprocess.snapshot_times(keys))
    return [
        *rows,
        (f"key-list snapshot of {keys:,} keys built", f"{built:.2f} s ({chunks} chunks)", "", None),
        ("  built + sent over gRPC + applied to sets", f"{sent:.2f} s", "<= 2 s", sent <= 2.0),
    ]


def summary_rows(keys: int) -> list[Row]:
    walk, summary, held = asyncio.run(inprocess.summary_times(keys))
    return [
        (
            f"residency summary of {keys:,} keys (GET /v1/residency)",
            f"{summary:.2f} s, the event loop held <= {held * 1e3:.0f} ms at a time",
            "",
            None,
        ),
        (
            "  the former walk of every key, the event loop held throughout",
            f"{walk:.2f} s",
            "",
            None,
        ),
    ]


def latency_rows(rate: int, seconds: float) -> list[Row]:
    m = asyncio.run(latency.measure(rate, seconds))
    p50, p99 = latency.percentile(m.latencies, 0.5), latency.percentile(m.latencies, 0.99)
    worst = max(m.latencies, default=0.0)
    return [
        ("published", f"{m.published:,.0f} block events/s", f"~{rate:,}", None),
        ("control plane CPU while ingesting and serving", f"{m.busy:.0%} of a core", "", None),
        (
            "control plane CPU per sidecar batch",
            f"{m.cpu_per_batch_s * 1e6:.0f} us (NATS in to gRPC out)",
            "",
            None,
        ),
        (
            "publish -> watcher p50 / p99 / max",
            f"{p50 * 1e3:.1f} / {p99 * 1e3:.1f} / {worst * 1e3:.1f} ms ({len(m.latencies):,} "
            f"samples, {m.lost} lost)",
            "p99 <= 100 ms",
            p99 <= 0.1 and m.lost == 0 and bool(m.latencies),
        ),
    ]


def shard_rows(load: shards.Load) -> list[Row]:
    """2 then 3 shards at one total rate; then what one core of control plane ingests,
    and the shards 1M block events/s would take at 70% of a core each."""
    rows: list[Row] = []
    per_core: list[float] = []
    for count in (2, 3):
        run = asyncio.run(shards.measure_run(replace(load, shards=count, watchers=1)))
        for figures in run.shards:
            per_core.append(figures.events_per_cpu_s)
            rows.append(
                (
                    f"{count} shards at {load.rate:,} block events/s: {figures.shard}",
                    figures.row().split(": ", 1)[1],
                    "none lost, only its pools watched",
                    figures.only_its_pools and figures.lost == 0,
                )
            )
        rows.append((f"{count} shards: the run", run.row(), "", None))
    busy = {}
    for watchers in (1, load.watchers):  # (one after the other, on the machine as it is)
        run = asyncio.run(shards.measure_run(replace(load, shards=2, watchers=watchers)))
        busy[watchers] = sum(f.busy for f in run.shards) / len(run.shards)
        rows.append((f"2 shards, {watchers} watchers each: the run", run.row(), "", None))
    per_watcher = (busy[load.watchers] - busy[1]) / max(load.watchers - 1, 1)
    rows.append(
        (
            f"a shard's CPU per further watcher ({load.watchers} vs 1, 2 shards)",
            f"{per_watcher:.1%} of a core ({busy[1]:.0%} -> {busy[load.watchers]:.0%})",
            "",
            None,
        )
    )
    ceiling = min(per_core)
    rows.append(
        (
            "control plane ingest per core (the least of the shards)",
            f"{ceiling:,.0f} block events/s per CPU second",
            "",
            None,
        )
    )
    rows.append(
        (
            "shards for 1M block events/s at 70% of a core each",
            f"ceil(1,000,000 / (0.7 x {ceiling:,.0f})) = {math.ceil(1e6 / (0.7 * ceiling))}",
            "",
            None,
        )
    )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.controlplane")
    parser.add_argument(
        "parts",
        nargs="*",
        default=["ingest", "memory", "snapshot", "summary", "latency", "shards"],
    )
    parser.add_argument("--events", type=int, default=2_000_000)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--rate", type=int, default=50_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--sidecars", type=int, default=256, help="shards: simulated sidecars")
    parser.add_argument("--publishers", type=int, default=4, help="shards: publisher processes")
    parser.add_argument(
        "--shard-rate", type=int, default=200_000, help="shards: block events/s in total"
    )
    parser.add_argument(
        "--watchers", type=int, default=8, help="shards: watch streams per shard, compared with 1"
    )
    args = parser.parse_args(argv)
    runs = {
        "ingest": lambda: ingest_rows(args.events),
        "memory": lambda: memory_rows(args.keys),
        "snapshot": lambda: snapshot_rows(args.keys),
        "summary": lambda: summary_rows(args.keys),
        "latency": lambda: latency_rows(args.rate, args.seconds),
        "shards": lambda: shard_rows(
            shards.Load(
                2,
                args.shard_rate,
                args.seconds,
                args.sidecars,
                args.publishers,
                watchers=args.watchers,
            )
        ),
    }
    unknown = set(args.parts) - set(runs)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from {list(runs)}")
    rows: list[Row] = []
    for part in args.parts:
        rows += runs[part]()
    for name, value, target, met in rows:
        verdict = "" if met is None else ("ok" if met else "MISSED")
        print(f"{name:<58} {value:<44} {target:<14} {verdict}".rstrip())
    return 1 if any(met is False for *_, met in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
