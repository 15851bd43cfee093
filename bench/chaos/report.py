"""The chaos report: ``chaos.json`` (every figure, every check), ``chaos.md`` (each
fault's figures beside its target) and, when matplotlib is installed, two plots: TTFT
over the run with each fault's window shaded, and each process's RSS over the soak."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.chaos.run import (
    CONVERGED_TARGET_S,
    PREDICTION_TARGET,
    ChaosConfig,
    ChaosResult,
    FaultResult,
)
from bench.chaos.soak import RSS_TARGET


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def fault_row(r: FaultResult) -> str:
    met = r.met
    failed = f"{r.failed} / {r.sent}" + (f" (+{r.cut} cut)" if r.cut else "")
    what = f"{r.what} ({r.note})" if r.note else r.what
    return (
        f"| {r.name} | {what} | {failed} {_mark(met['failed'])} "
        f"| {_s(r.converged_s)} {_mark(met['converged'])} "
        f"| {r.predicted_during:,} / {r.measured_during:,} "
        f"| {r.predicted_after:,} / {r.measured_after:,} {_mark(met['prediction_after'])} "
        f"| {_ms(r.ttft_p99_during_s)} |"
    )


def markdown(config: ChaosConfig, result: ChaosResult, command: str) -> str:
    lines = [
        "# Chaos benchmark",
        "",
        f"`{command}`: {config.replicas} kvroute-sim engines with their sidecars, two control "
        "planes (HA), two proxies behind a TCP round-robin balancer, NATS and etcd, all on "
        f"127.0.0.1; streamed chat requests at {config.rate:g}/s open loop on "
        f"{config.prompts} shared system prompts; hold {config.hold_s:g} s, partition "
        f"{config.partition_s:g} s.",
        "",
        f"| fault | what | failed / sent (target 0) | residency = caches again after the "
        f"fault (target <= {CONVERGED_TARGET_S:g} s) | cached tokens predicted / measured, "
        f"during | after (target within {PREDICTION_TARGET:.0%}) | TTFT p99 during |",
        "|---|---|---|---|---|---|---|",
        *(fault_row(r) for r in result.faults),
        "",
        "*cut*: streams already running on a replica that was then killed, ended by a clean "
        "error event (allowed). *During*: from the fault's start until the residency "
        "equalled the caches again; *after*: the next "
        f"{config.after_s:g} s.",
    ]
    if result.soak is not None:
        lines += ["", *soak_lines(result.soak.summary())]
    return "\n".join(lines) + "\n"


def soak_lines(soak: dict[str, Any]) -> list[str]:
    met = soak["met"]
    rows = [
        f"| {p['process']} | {p['rss_first_mib']} | {p['rss_last_mib']} | "
        f"{(p['rss_change'] or 0):+.1%} | {p['fds_last']} | {p['fd_growth']:+d} | "
        f"{_mark(p['met'])} |"
        for p in soak["processes"]
    ]
    return [
        f"## Soak: {soak['duration_s']:g} s at {soak['rate']:g} requests/s "
        f"(after {soak['warmup_s']:g} s of warm-up)",
        "",
        f"- failed {soak['failed']} / {soak['sent']} (target 0): {_mark(met['failed'])}; "
        f"TTFT p99 {_ms(soak['ttft_p99_s'])}",
        f"- residency above the engines' caches: at most {soak['max_extra_keys']} keys over "
        f"{soak['checks']} key-for-key checks (target 0): {_mark(met['never_above_caches'])}; "
        f"keys missing at most {soak['max_missing_keys']}",
        f"- RSS flat within {RSS_TARGET:.0%}: {_mark(met['rss_flat'])}; "
        f"no fd growth: {_mark(met['no_fd_growth'])}",
        "",
        "| process | RSS first (MiB) | RSS last (MiB) | change | fds | fd growth | |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def write(out: Path, config: ChaosConfig, result: ChaosResult, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": command,
        "config": {k: v for k, v in vars(config).items()},
        "faults": [r.summary() for r in result.faults],
        "soak": None if result.soak is None else result.soak.summary(),
    }
    (out / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "chaos.md").write_text(markdown(config, result, command))
    _plots(out, result)


def _plots(out: Path, result: ChaosResult) -> None:
    try:
        import matplotlib
    except ImportError:  # the [bench] extra: the figures are in the JSON either way
        return
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4))
    ax.scatter([t for t, _ in result.timeline], [v * 1e3 for _, v in result.timeline], s=2)
    for name, began, ended in result.windows:
        ax.axvspan(began, max(ended, began + 0.5), alpha=0.2, color="tab:red")
        ax.text(began, ax.get_ylim()[1] * 0.9, name, rotation=90, fontsize=7, va="top")
    ax.set(xlabel="s since the load began", ylabel="TTFT (ms)", yscale="log",
           title="TTFT of every request; faults shaded")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "chaos_ttft.png", dpi=110)
    plt.close(fig)
    if result.soak is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    for trend in result.soak.processes:
        ax.plot([t for t, _ in trend.samples], [s.rss_kib / 1024 for _, s in trend.samples],
                label=trend.name)  # fmt: skip
    ax.set(xlabel="s since the soak began", ylabel="RSS (MiB)", title="RSS over the soak")
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "chaos_soak_rss.png", dpi=110)
    plt.close(fig)
