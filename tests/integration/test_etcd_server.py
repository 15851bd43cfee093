"""The etcd_server fixture runs a real etcd: put/get, watch, and keys held by a lease."""

from __future__ import annotations

import asyncio

import aetcd
import pytest

from kvcore.subjects import EtcdKeys
from kvroute.servers import EtcdServer

pytestmark = pytest.mark.integration

KEYS = EtcdKeys("/kvroute-test/")


async def connect(server: EtcdServer) -> aetcd.Client:
    client = aetcd.Client(host="127.0.0.1", port=server.port, timeout=10)
    await client.connect()
    return client


async def test_put_then_get_returns_the_workload_policy(etcd_server: EtcdServer) -> None:
    async with await connect(etcd_server) as client:
        key = KEYS.workload("chat").encode()
        await client.put(key, b'{"strategy": "kv_aware"}')
        got = await client.get(key)
        assert got is not None and got.value == b'{"strategy": "kv_aware"}'


async def test_watch_sees_membership_put_and_lease_expiry_removes_it(
    etcd_server: EtcdServer,
) -> None:
    async with await connect(etcd_server) as client:
        prefix = KEYS.replicas_prefix("pool-w").encode()
        watch = await client.watch_prefix(prefix)
        lease = await client.lease(ttl=30)
        member = KEYS.replica("pool-w", "r1").encode()
        await client.put(member, b"http://127.0.0.1:8100", lease=lease)

        events = watch.__aiter__()
        put = await asyncio.wait_for(events.__anext__(), timeout=10)
        assert put.kind == aetcd.EventKind.PUT and put.kv.key == member

        await lease.revoke()  # what happens when the leader stops keeping it alive
        gone = await asyncio.wait_for(events.__anext__(), timeout=10)
        assert gone.kind == aetcd.EventKind.DELETE and gone.kv.key == member
        assert await client.get(member) is None
        await watch.cancel()
