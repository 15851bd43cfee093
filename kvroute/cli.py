"""The ``kvroute`` command: run kvroute locally, benchmark it, explain a routing decision.

``kvroute bench NAME [ARGS...]`` runs one benchmark of ``BENCHMARKS`` (each a
``module:function`` taking its own argument list and returning an exit status), so that
a new benchmark is one line in that table.

``kvroute up`` will run a whole local fleet (engines, sidecars, control plane, proxy). Until
those parts exist it runs the fleet's infrastructure smoke check: it starts real
nats-server and etcd processes on free loopback ports, proves a kvroute message round
trip through each, and stops them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
import time
from collections.abc import Sequence

import aetcd
import nats

from kvcore import subjects
from kvcore.pb import events_pb2
from kvroute.servers import EtcdServer, NatsServer, ServerStartError

# name -> (module:function taking argv and returning an exit status, what it measures)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "sim": ("bench.sim.__main__:main", "discrete-event simulation: strategies, peers, oracle"),
    "micro": ("bench.micro.__main__:main", "routing core micro benchmarks"),
    "sidecar": ("bench.sidecar_throughput:main", "sidecar events/s and publish latency"),
    "enginesim": ("bench.enginesim_capacity:main", "one kvroute-sim's request capacity"),
    # "e2e": ("bench.e2e.__main__:main", "real processes, kvroute beside the peer routers"),
    # "proxy": ("bench.proxy:main", "the proxy's overhead and throughput"),
    "controlplane": (
        "bench.controlplane.__main__:main",
        "control-plane ingest, memory, snapshot and publish-to-watcher latency",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up", help="run kvroute locally on embedded defaults")
    bench = commands.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(BENCHMARKS),
        description="\n".join(f"{name}: {what}" for name, (_, what) in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    commands.add_parser("explain", help="explain a routing decision (not implemented yet)")
    return parser


async def _nats_round_trip(url: str) -> float:
    nc = await nats.connect(url)
    try:
        subject = subjects.announce_subject("default")
        sub = await nc.subscribe(subject)
        announce = events_pb2.ReplicaAnnounce(replica_id="smoke", pool="default", ts=time.time())
        started = time.perf_counter()
        await nc.publish(subject, announce.SerializeToString())
        msg = await sub.next_msg(timeout=5)
        if events_pb2.ReplicaAnnounce.FromString(msg.data).replica_id != "smoke":
            raise RuntimeError("NATS returned a different message")
        return time.perf_counter() - started
    finally:
        await nc.close()


async def _etcd_round_trip(port: int) -> float:
    async with aetcd.Client(host="127.0.0.1", port=port, timeout=10) as client:
        key = subjects.EtcdKeys().workload("default").encode()
        started = time.perf_counter()
        await client.put(key, b'{"strategy": "round_robin"}')
        got = await client.get(key)
        if got is None or got.value != b'{"strategy": "round_robin"}':
            raise RuntimeError("etcd returned a different value")
        return time.perf_counter() - started


def smoke_check() -> int:
    """Start the fleet's infrastructure, prove a round trip through each part, stop it."""
    try:
        with NatsServer() as nats_server, EtcdServer() as etcd_server:
            print(f"nats-server ready at {nats_server.url}")
            print(f"etcd ready at {etcd_server.endpoint}")
            nats_s = asyncio.run(_nats_round_trip(nats_server.url))
            etcd_s = asyncio.run(_etcd_round_trip(etcd_server.port))
    except (ServerStartError, RuntimeError, OSError) as exc:
        print(f"kvroute up: smoke check failed: {exc}", file=sys.stderr)
        return 1
    print(f"NATS round trip of a ReplicaAnnounce: {nats_s * 1e3:.2f} ms")
    print(f"etcd put+get of a workload policy: {etcd_s * 1e3:.2f} ms")
    print("smoke check passed; the local fleet demo arrives with the `kvroute up` issue")
    return 0


def run_benchmark(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` of ``BENCHMARKS`` with its own arguments."""
    module_name, _, function = BENCHMARKS[name][0].partition(":")
    entry = getattr(importlib.import_module(module_name), function)
    status = entry(argv)
    return int(status or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "up":
        return smoke_check()
    if args.command == "bench":
        return run_benchmark(args.benchmark, args.args)
    print(f"kvroute {args.command}: not implemented yet", file=sys.stderr)
    return 2
