"""``kvroute bench proxy``'s verdicts (like-for-like ratios, bounds each way, routers not
run) and its CPU pinning of a router's whole process tree."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.proxy import (
    QUESTIONS,
    WARM_UP,
    Target,
    direct_targets,
    latencies,
    parse_args,
    short_prompt,
    warm,
)
from bench.proxy_report import (
    FLEET_STRATEGY,
    HOP,
    Measured,
    Results,
    Row,
    all_met,
    awake_rows,
    extra_rows,
    latency_rows,
    limited_rows,
    paired_names,
    throughput_rows,
    write_json,
)
from bench.proxy_routers import descendants, pin_tree, split_cpus, tree_cpu_seconds
from controlplane.records.config_store import default_workload_json

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"


async def _requests(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The body of each request a client sends on one connection, until it hangs up."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        yield await reader.readexactly(length)


def _results(**routers: Measured) -> Results:
    results = Results(direct_ms=0.3, direct_rps=2000.0)
    for measured in routers.values():
        results.routers[measured.name] = measured
    return results


def _everyone(kv_rps: float, kv_ms: float) -> Results:
    return _results(
        a=Measured("kvroute round_robin", added_ms=0.25, rps=1900.0),
        b=Measured("kvroute kv_cost", added_ms=kv_ms, rps=kv_rps),
        c=Measured("sglang-router round_robin", added_ms=0.26, rps=2000.0),
        d=Measured("sglang-router cache_aware", added_ms=0.27, rps=1000.0),
        e=Measured("vllm-router round_robin", added_ms=0.6, rps=1500.0),
        f=Measured("vllm-router cache_aware", added_ms=0.7, rps=900.0),
    )


def _row(rows: list[Row], name: str) -> Row:
    return next(row for row in rows if row.name.strip() == name)


def test_throughput_is_judged_like_for_like_against_sglang_router() -> None:
    rows = throughput_rows(_everyone(kv_rps=850.0, kv_ms=0.2), 32)
    rr = _row(rows, "kvroute round_robin / sglang-router round_robin")
    assert (round(rr.value or 0, 3), rr.verdict) == (0.95, "met")
    kv = _row(rows, "kvroute kv_cost / sglang-router cache_aware")
    assert (round(kv.value or 0, 3), kv.verdict) == (0.85, "MISSED")
    beside = _row(rows, "kvroute kv_cost / vllm-router cache_aware")
    assert beside.target is None and beside.verdict == ""  # vllm-router: printed, not judged
    assert "ceiling" in _row(rows, "throughput, sglang-router round_robin").note
    assert not all_met(rows)


def test_the_fleet_is_measured_with_the_default_workloads_strategy() -> None:
    """A user's ``kvroute up`` proxy routes with the default workload's strategy: the
    figures published as kvroute's must be that strategy's, not one they must choose."""
    assert json.loads(default_workload_json())["strategy"] == FLEET_STRATEGY


def test_the_fleets_cpu_beside_the_replicas_is_shown_with_its_throughput() -> None:
    results = _everyone(kv_rps=850.0, kv_ms=0.2)
    results.routers["kvroute kv_cost"].helpers_share = 0.37
    results.routers["sglang-router cache_aware"].helpers_share = 0.35
    rows = throughput_rows(results, 32)
    assert "took 37% of a core beside the replicas" in (
        _row(rows, "throughput, kvroute kv_cost").note
    )
    assert "took 35% of a core beside the replicas" in (
        _row(rows, "throughput, sglang-router cache_aware").note
    )
    assert "fleet" not in _row(rows, "throughput, vllm-router cache_aware").note


def test_added_latency_needs_both_the_bound_and_sglang_routers_figure() -> None:
    rows = latency_rows(_everyone(kv_rps=1000.0, kv_ms=0.28))
    assert _row(rows, "added latency p50, kvroute kv_cost").verdict == "met"  # <= 0.3 ms
    assert _row(rows, "kvroute kv_cost / sglang-router cache_aware").verdict == "MISSED"
    assert _row(rows, "kvroute round_robin / sglang-router round_robin").verdict == "met"
    assert all_met(latency_rows(_everyone(kv_rps=1000.0, kv_ms=0.27)))


def test_every_replica_gets_as_many_latency_requests_each_round_floors_included() -> None:
    replicas = ["http://r0", "http://r1", "http://r2"]
    routers = [Target("kvroute round_robin", "http://p0"), Target("sglang", "http://p1")]
    floors = [Target(f"floor {i}", f"http://f{i}", replica="http://r0") for i in range(3)]
    sent = [d.url for d in direct_targets(replicas, routers + floors)]
    # r0 gets one direct and the three floors' requests; r1 and r2 as many, all direct
    assert (sent.count("http://r0"), sent.count("http://r1"), sent.count("http://r2")) == (1, 4, 4)
    assert [d.url for d in direct_targets(replicas, routers)] == replicas  # no floors: one each


def test_each_replicas_own_direct_latency_is_printed_beside_the_pooled_one() -> None:
    results = _everyone(kv_rps=1000.0, kv_ms=0.28)
    results.direct_each_ms = [0.25, 0.35]
    rows = latency_rows(results)
    assert rows[0].value == 0.3 and "each in turn" in rows[0].name
    assert [(r.name.strip(), r.value) for r in rows[1:3]] == [
        ("direct to replica 0 alone (p50)", 0.25),
        ("direct to replica 1 alone (p50)", 0.35),
    ]


def test_a_peer_that_did_not_run_is_reported_and_not_counted_as_met() -> None:
    results = _results(
        a=Measured("kvroute round_robin", added_ms=0.2, rps=1900.0),
        c=Measured("sglang-router round_robin", unavailable="install failed: no network"),
    )
    rows = throughput_rows(results, 32)
    ratio = _row(rows, "kvroute round_robin / sglang-router round_robin")
    assert ratio.value is None and ratio.verdict == "NOT RUN"
    assert "install failed: no network" in ratio.note
    assert _row(rows, "throughput, vllm-router round_robin").verdict == "not run"
    assert not all_met(rows)


def test_throughput_under_a_cpu_limit_is_judged_like_for_like_too() -> None:
    results = _everyone(kv_rps=950.0, kv_ms=0.2)
    results.cpu_limit = "400m"
    for name, rps in (
        ("kvroute round_robin", 900.0),
        ("sglang-router round_robin", 1000.0),
        ("kvroute kv_cost", 700.0),
        ("sglang-router cache_aware", 1000.0),
    ):
        results.routers[name].limited_rps = rps
        results.routers[name].limited_share = 0.4
        results.routers[name].limited_throttled = 30
    rows = limited_rows(results, 32)  # fmt: skip
    rr = _row(rows, "kvroute round_robin / sglang-router round_robin, under a CPU limit of 400m")
    assert (round(rr.value or 0, 3), rr.verdict) == (0.9, "met")
    kv = _row(rows, "kvroute kv_cost / sglang-router cache_aware, under a CPU limit of 400m")
    assert (round(kv.value or 0, 3), kv.verdict) == (0.7, "MISSED")
    assert "stalled by the limit in 30 periods" in (
        _row(rows, "throughput under a CPU limit of 400m, kvroute kv_cost").note
    )
    vllm = _row(rows, "throughput under a CPU limit of 400m, vllm-router cache_aware")
    assert vllm.value is None and vllm.verdict == "not run"
    assert not all_met(rows)


def test_a_machine_where_no_cpu_limit_can_be_set_says_why_and_is_not_met() -> None:
    results = _everyone(kv_rps=950.0, kv_ms=0.2)
    assert limited_rows(results, 32) == []  # no limit asked for (--cpu-limit 0)
    results.limit_unavailable = "cannot make the cgroup: Permission denied"
    rows = limited_rows(results, 32)
    ratio = _row(rows, "kvroute kv_cost / sglang-router cache_aware, under a CPU limit")
    assert ratio.verdict == "NOT RUN" and "Permission denied" in ratio.note
    assert not all_met(rows)


def test_json_keeps_every_figure_with_its_verdict(tmp_path: Path) -> None:
    results = _everyone(kv_rps=950.0, kv_ms=0.2)
    rows = latency_rows(results) + throughput_rows(results, 32)
    write_json(tmp_path / "p" / "proxy.json", rows, results, {"command": ["x"]})
    document = json.loads((tmp_path / "p" / "proxy.json").read_text())
    assert document["all_met"] is True and document["command"] == ["x"]
    assert len(document["figures"]) == len(rows)
    assert document["results"]["routers"]["kvroute kv_cost"]["rps"] == 950.0


def test_cpus_split_gives_routers_one_and_the_rest_the_others() -> None:
    split = split_cpus({3, 1, 2})
    assert split is not None and split.routers == {1} and split.rest == {2, 3}
    assert split_cpus({0}) is None


def test_arguments_quick_and_unknown_peer(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--quick", "--peers", "sglang-router"])
    assert (args.rounds, args.repeats) == (500, 1)
    with pytest.raises(SystemExit):
        parse_args(["--peers", "nginx"])
    assert "unknown peer(s) ['nginx']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--cpu-limit", "-0.5"])
    assert "--cpu-limit must be 0 (no limited runs) or more cores" in capsys.readouterr().err
    assert parse_args(["--cpu-limit", "0"]).cpu_limit == 0


def test_pin_tree_pins_every_thread_of_a_process_and_its_children() -> None:
    """The same CPU budget for every router rests on this: threads started before the pin
    (a runtime's worker pool) and child processes (workers) are pinned too."""
    cpu = min(os.sched_getaffinity(0))
    code = "\n".join([
        "import subprocess, sys, threading, time",
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()",
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])",
        "while time.process_time() < 0.3: pass",  # CPU the benchmark's accounting must see
        "print(child.pid, flush=True)",
        "sys.stdin.read()",
    ])  # fmt: skip
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        try:
            assert set(descendants(parent.pid)) == {parent.pid, child}
            assert pin_tree(parent.pid, frozenset({cpu})) >= 3  # main thread, its thread, child
            for pid in (parent.pid, child):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    assert os.sched_getaffinity(int(task.name)) == {cpu}
            assert tree_cpu_seconds(parent.pid) >= 0.25  # /proc counts in clock ticks
        finally:
            os.kill(child, signal.SIGKILL)
            parent.kill()


def test_warming_sends_every_throughput_prompt_once_to_every_replica() -> None:
    seen: dict[int, list[str]] = {}

    async def main() -> int:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            port = writer.get_extra_info("sockname")[1]
            async for body in _requests(reader):
                seen.setdefault(port, []).append(json.loads(body)["prompt"])
                writer.write(OK)
            writer.close()

        servers = [await asyncio.start_server(serve, "127.0.0.1", 0) for _ in range(2)]
        urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
        try:
            return await warm(urls, 4)
        finally:
            for server in servers:
                server.close()

    assert asyncio.run(main()) == 0
    prompts = {short_prompt(client, i) for client in range(4) for i in range(QUESTIONS)}
    assert len(seen) == 2
    assert all(sorted(sent) == sorted(prompts) for sent in seen.values())


class _Loops:
    """Stands in for ``Wakefulness``: says whether its CPUs would be kept awake."""

    def __init__(self) -> None:
        self.awake = False

    def keep_awake(self) -> None:
        self.awake = True

    def let_idle(self) -> None:
        self.awake = False


def test_awake_rounds_alternate_with_idle_ones_and_are_kept_apart() -> None:
    loops = _Loops()
    answered_awake: list[bool] = []

    async def main() -> Target:
        served = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async for _ in _requests(reader):
                answered_awake.append(loops.awake)
                writer.write(OK)
            writer.close()
            await writer.wait_closed()
            served.set()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        target = Target("router", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            await latencies([target], 20, loops)  # type: ignore[arg-type]
            await asyncio.wait_for(served.wait(), 10)  # the client hung up: all answered
        finally:
            server.close()
            await server.wait_closed()
        return target

    target = asyncio.run(main())
    assert len(target.samples) == len(target.awake_samples) == 20
    assert answered_awake == [False, True] * (20 + WARM_UP)


def test_awake_figures_are_printed_beside_without_targets() -> None:
    results = _results(a=Measured("kvroute round_robin", added_ms=0.35, awake_added_ms=0.2))
    assert awake_rows(results) == []  # no --awake rounds: nothing printed
    results.awake_direct_ms = 0.28
    rows = awake_rows(results)
    assert [row.value for row in rows] == [0.28, 0.2]
    assert "kept awake" in rows[1].name and "kvroute round_robin" in rows[1].name
    assert all(row.target is None for row in rows)  # they decide nothing


def test_the_hops_own_cost_is_printed_with_the_direct_latency_and_decides_nothing() -> None:
    results = _everyone(kv_rps=1000.0, kv_ms=0.32)
    results.direct_each_ms = [0.29, 0.31]
    results.routers[HOP] = Measured(HOP, added_ms=0.31)  # a slow phase: the hop alone > 0.3
    rows = latency_rows(results)
    hop = rows[3]  # right after the pooled and each replica's direct latency
    assert "the hop alone" in hop.name and hop.value == 0.31 and hop.target is None
    assert _row(rows, "added latency p50, kvroute kv_cost").verdict == "MISSED"  # still judged
    assert not all_met(rows)
    # not repeated among the other routers, and no throughput row it was not timed for
    assert extra_rows(results, paired_names()) == []
    results.routers[HOP].rps = 9000.0  # --floors: its throughput too
    assert [row.name for row in extra_rows(results, paired_names())] == [f"throughput, {HOP}"]
