"""Fixtures of the records half's tests: real etcd, SQLite and PostgreSQL databases, a
small in-test FleetView (the other half's test double), and Records served by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json as _json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aetcd
import aiohttp
import asyncpg
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from controlplane.contracts import ReplicaInfo, ResidencySummary, SharedPrefix, UnknownReplica
from controlplane.records import Records
from controlplane.settings import ControlPlaneSettings
from kvcore.index import BitmaskResidencyIndex
from kvcore.policies import ReplicaState, StateView, StaticStateView
from kvroute.servers import EtcdServer, PostgresServer

ADMIN_TOKEN = "test-admin-token-0123456789"


class InTestFleet:
    """A FleetView over a kvcore StaticStateView: replicas and residency set by the test."""

    def __init__(self, replicas: Sequence[ReplicaInfo] = (), *, leader: bool = True) -> None:
        self.infos = {info.replica_id: info for info in replicas}
        self.index = BitmaskResidencyIndex()
        self.leader = leader

    def ordinal(self, replica_id: str) -> int:
        return list(self.infos).index(replica_id)

    def hold(self, replica_id: str, keys: Sequence[int]) -> None:
        self.index.add(self.ordinal(replica_id), keys)

    def replicas(self, pool: str | None = None) -> Sequence[ReplicaInfo]:
        return [i for i in self.infos.values() if pool is None or i.pool == pool]

    async def set_draining(self, replica_id: str, draining: bool) -> ReplicaInfo:
        if replica_id not in self.infos:
            raise UnknownReplica(replica_id)
        status = "draining" if draining else "healthy"
        info = replace(self.infos[replica_id], draining=draining, status=status)
        self.infos[replica_id] = info
        return info

    async def residency_summary(self, top: int = 20) -> ResidencySummary:
        per_replica = {rid: self.index.key_count(self.ordinal(rid)) for rid in self.infos}
        ids = list(self.infos)
        shared = sorted(
            (
                SharedPrefix(key, tuple(ids[o] for o in range(len(ids)) if mask >> o & 1))
                for key, mask in self.index.holdings()
            ),
            key=lambda s: (-len(s.holders), s.key),
        )
        return ResidencySummary(self.index.key_count(), per_replica, tuple(shared[:top]))

    def state_view(self, pool: str | None = None) -> StateView:
        states = [
            ReplicaState(
                ordinal=self.ordinal(info.replica_id),
                replica_id=info.replica_id,
                models=frozenset((info.model, *info.served_names, *info.lora_adapters)),
                healthy=info.status != "down",
                draining=info.draining,
                running=info.running,
                waiting=info.waiting,
                kv_usage=info.kv_usage,
            )
            for info in self.replicas(pool)
        ]
        return StaticStateView(states, self.index)

    def state_position(self) -> tuple[int, int]:
        return (7, 42)  # what a broadcaster would say: (epoch, version)

    def is_leader(self) -> bool:
        return self.leader


def replica_info(
    replica_id: str, *, model: str = "kvroute/sim-model", **fields: Any
) -> ReplicaInfo:
    values: dict[str, Any] = {
        "replica_id": replica_id,
        "pool": "default",
        "base_url": f"http://127.0.0.1:81{replica_id[-1]}0",
        "model": model,
        "served_names": (),
        "engine_kind": "vllm",
        "status": "healthy",
        "draining": False,
        "state_incomplete": False,
        "epoch": 1,
        "block_size": 16,
        "running": 0,
        "waiting": 0,
        "kv_usage": 0.0,
        "resident_blocks": 0,
        "prefix_cache_queries": None,
        "prefix_cache_hits": None,
        "last_seen": 0.0,
    }
    values.update(fields)
    return ReplicaInfo(**values)


@pytest.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[aetcd.Client]:
    client = aetcd.Client(host="127.0.0.1", port=etcd_server.port, timeout=10)
    await client.connect()
    yield client
    await client.close()


@pytest.fixture
def etcd_prefix() -> str:
    return f"/kvroute-test-{random.randrange(1 << 40):x}/v1/"


@pytest.fixture(params=["sqlite", "postgresql"])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'records.db'}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = f"records_{random.randrange(1 << 40):x}"
    admin = await asyncpg.connect(server.url("postgresql"))
    try:
        await admin.execute(f"CREATE DATABASE {name}")
        yield server.url().rsplit("/", 1)[0] + f"/{name}"
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
    finally:
        await admin.close()


def make_settings(database_url: str, etcd_prefix: str, **fields: Any) -> ControlPlaneSettings:
    values: dict[str, Any] = {
        "database_url": database_url,
        "etcd_prefix": etcd_prefix,
        "admin_token": ADMIN_TOKEN,
        "rollup_interval_s": 600,  # tests roll up by hand unless they say otherwise
    }
    values.update(fields)
    return ControlPlaneSettings(**values)


RecordsFactory = Callable[..., Awaitable[Records]]


@pytest.fixture
async def make_records(
    etcd: aetcd.Client, database_url: str, etcd_prefix: str
) -> AsyncIterator[RecordsFactory]:
    """Build and start Records (each call: another instance on the same etcd and SQL)."""
    started: list[Records] = []

    async def make(fleet: InTestFleet | None = None, **fields: Any) -> Records:
        settings = make_settings(database_url, etcd_prefix, **fields)
        records = Records(settings, etcd, fleet or InTestFleet(), CollectorRegistry())
        await records.start()
        started.append(records)
        return records

    yield make
    for records in reversed(started):
        await records.aclose()


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn on a free loopback port; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


class AdminClient:
    """The admin API over real HTTP, as an operator's tool would call it."""

    def __init__(self, http: aiohttp.ClientSession, base: str, token: str | None) -> None:
        self.http = http
        self.base = base
        self.token = token

    def as_token(self, token: str | None) -> AdminClient:
        return AdminClient(self.http, self.base, token)

    async def call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, Mapping[str, str]]:
        sent = dict(headers or {})
        data = None if raw is None else io.BytesIO(raw)
        if self.token is not None:
            sent["Authorization"] = f"Bearer {self.token}"
        async with self.http.request(
            method, self.base + path, json=json, data=data, headers=sent
        ) as reply:
            text = await reply.text()
            body = _json.loads(text) if reply.content_type == "application/json" else text
            return reply.status, body, reply.headers.copy()


@contextlib.asynccontextmanager
async def admin_client(
    records: Records, token: str | None = ADMIN_TOKEN
) -> AsyncIterator[AdminClient]:
    async with serve(records.app) as base, aiohttp.ClientSession() as http:
        yield AdminClient(http, base, token)
