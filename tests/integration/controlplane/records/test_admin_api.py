"""The admin API over real HTTP, on real etcd and SQL: ETags, tokens, bad input,
revisions, the fleet routes and explain."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable

import aetcd
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from controlplane.records import Records
from controlplane.records.config_store import Kind
from kvcore.keys import block_keys
from kvcore.request import prompt_token_ids
from kvcore.tokenize import load_tokenizer
from tests.integration.controlplane.records.conftest import (
    InTestFleet,
    RecordsFactory,
    admin_client,
    make_settings,
    replica_info,
)

pytestmark = pytest.mark.integration
sqlite_only = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


async def until(records: Records, predicate: Callable[[], bool]) -> None:
    """Wait until the config store's watch has delivered what ``predicate`` checks."""
    changed = asyncio.Event()
    records.store.subscribe(changed.set)
    async with asyncio.timeout(10):
        while not predicate():
            await changed.wait()
            changed.clear()


async def test_two_admins_writing_with_the_same_etag_one_wins_one_gets_412(
    make_records: RecordsFactory,
) -> None:
    first, second = await make_records(), await make_records()  # two instances
    async with admin_client(first) as alice, admin_client(second) as bob:
        status, _, headers = await alice.call(
            "PUT", "/v1/workloads/chat", json={"strategy": "kv_aware"}
        )
        assert status == 201
        status, body, headers = await bob.call("GET", "/v1/workloads/chat")
        assert status == 200 and body["strategy"] == "kv_aware"
        tag = headers["ETag"]

        results = await asyncio.gather(
            alice.call(
                "PUT",
                "/v1/workloads/chat",
                json={"strategy": "kv_aware", "locality_weight": 0.9},
                headers={"If-Match": tag},
            ),
            bob.call(
                "PUT",
                "/v1/workloads/chat",
                json={"strategy": "kv_aware", "locality_weight": 0.2},
                headers={"If-Match": tag},
            ),
        )
        statuses = sorted(status for status, _, _ in results)
        assert statuses == [200, 412]
        winner = next(body for status, body, _ in results if status == 200)

        status, body, headers = await bob.call("GET", "/v1/workloads/chat")
        assert body == winner and headers["ETag"] != tag
        status, audit, _ = await alice.call("GET", "/v1/audit?limit=10")
        puts = [e for e in audit["entries"] if e["target"] == "workload/chat"]
        assert sorted(e["result"] for e in puts) == ["ok", "ok", "precondition_failed"]
        status, revisions, _ = await alice.call("GET", "/v1/workloads/chat/revisions")
        assert [r["action"] for r in revisions["revisions"]] == ["put", "put"]
        assert revisions["revisions"][0]["after"] == winner

    # both instances' proxies see the winner
    for records in (first, second):
        await until(
            records,
            lambda r=records: (
                r.store.workloads().get("chat") is not None
                and r.store.workloads()["chat"].locality_weight == winner["locality_weight"]
            ),
        )


@sqlite_only
async def test_tokens_scopes_and_inference_keys_reaching_proxies(
    make_records: RecordsFactory,
) -> None:
    records = await make_records()
    async with admin_client(records) as admin:
        assert (await admin.as_token(None).call("GET", "/v1/workloads"))[0] == 401
        assert (await admin.as_token("nope").call("GET", "/v1/workloads"))[0] == 401
        assert (await admin.as_token(None).call("GET", "/healthz"))[0] == 200

        status, reader, _ = await admin.call(
            "POST", "/v1/tokens", json={"name": "dash", "scopes": ["read"]}
        )
        assert status == 201 and reader["token"].startswith("kvr_")
        as_reader = admin.as_token(reader["token"])
        assert (await as_reader.call("GET", "/v1/workloads"))[0] == 200
        assert (await as_reader.call("PUT", "/v1/workloads/x", json={"strategy": "least_load"}))[
            0
        ] == 403

        status, client, _ = await admin.call(
            "POST",
            "/v1/tokens",
            json={
                "name": "team-a",
                "scopes": ["inference"],
                "tenant": "team-a",
                "default_workload": "default",
            },
        )
        assert status == 201
        assert (await admin.as_token(client["token"]).call("GET", "/v1/workloads"))[0] == 403
        digest = hashlib.sha256(client["token"].encode()).hexdigest()
        await until(
            records, lambda: any(k.key_sha256 == digest for k in records.config.current().api_keys)
        )
        (key,) = records.config.current().api_keys
        assert (key.tenant, key.default_workload, list(key.scopes)) == (
            "team-a",
            "default",
            ["inference"],
        )

        status, listed, _ = await admin.call("GET", "/v1/tokens")
        assert {t["name"] for t in listed["tokens"]} == {"dash", "team-a"}
        assert "token" not in json.dumps(listed["tokens"]).replace('"tokens"', "")
        assert (await admin.call("DELETE", f"/v1/tokens/{client['id']}"))[0] == 204
        await until(records, lambda: not records.config.current().api_keys)
        assert (await admin.call("DELETE", f"/v1/tokens/{reader['id']}"))[0] == 204
        assert (await as_reader.call("GET", "/v1/workloads"))[0] == 401


@sqlite_only
async def test_bad_input_gets_a_clear_4xx(make_records: RecordsFactory) -> None:
    records = await make_records()
    async with admin_client(records) as admin:
        status, body, _ = await admin.call(
            "PUT", "/v1/workloads/chat", json={"strategy": "kv_aware", "locality_weight": 2}
        )
        assert status == 422 and "locality_weight" in json.dumps(body["detail"])
        status, body, _ = await admin.call(
            "PUT", "/v1/workloads/chat", json={"strategy": "kv_aware", "alpha": 1}
        )
        assert status == 422 and "alpha" in json.dumps(body["detail"])
        status, body, _ = await admin.call(
            "PATCH", "/v1/workloads/default", json={"load_threshold": 0}
        )
        assert status == 422 and "load_threshold" in json.dumps(body["detail"])
        status, body, _ = await admin.call(
            "PUT", "/v1/workloads/Chat_1", json={"strategy": "kv_aware"}
        )
        assert status == 422 and "name" in json.dumps(body["detail"])
        status, body, _ = await admin.call(
            "PUT", "/v1/workloads/" + "a" * 64, json={"strategy": "kv_aware"}
        )
        assert status == 422
        status, body, _ = await admin.call(
            "PUT", "/v1/workloads/chat", json={"strategy": "kv_aware", "name": "other"}
        )
        assert status == 422 and "name" in json.dumps(body["detail"])
        big = json.dumps({"name": "big", "tokenizer": "x" * (1 << 20)}).encode()
        status, body, _ = await admin.call(
            "PUT", "/v1/models/big", raw=big, headers={"Content-Type": "application/json"}
        )
        assert status == 413
        assert (await admin.call("GET", "/v1/workloads/missing"))[0] == 404
        assert (await admin.call("DELETE", "/v1/workloads/default"))[0] == 409
        assert (await admin.call("GET", "/v1/audit?limit=0"))[0] == 422
        # nothing refused reached etcd
        assert set(records.store.workloads()) == {"default"}
        # a value written by hand that is not JSON is shown as text, and can be fixed
        await records.store.swap(Kind.WORKLOAD, "typo", "{strategy: kv_aware", 0)
        status, body, _ = await admin.call("GET", "/v1/workloads/typo")
        assert (status, body) == (200, "{strategy: kv_aware")
        status, body, _ = await admin.call(
            "PATCH", "/v1/workloads/typo", json={"strategy": "least_load"}
        )
        assert (status, body["strategy"], body["name"]) == (200, "least_load", "typo")


@sqlite_only
async def test_a_strategy_change_by_patch_keeps_what_applies_and_says_what_it_dropped(
    make_records: RecordsFactory,
) -> None:
    """PATCH {"strategy": ...} alone: the new strategy keeps the settings it has too,
    drops the ones it has not (and says which, in a header and the audit); a setting
    the patch itself sends that the strategy has not is refused, naming it."""
    records = await make_records()
    async with admin_client(records) as admin:
        tuned = {"strategy": "kv_aware", "locality_weight": 0.4, "min_hit": 0.2,
                 "load_threshold": 0.8}  # fmt: skip
        assert (await admin.call("PUT", "/v1/workloads/chat", json=tuned))[0] == 201
        status, body, headers = await admin.call(
            "PATCH", "/v1/workloads/chat", json={"strategy": "kv_cost"}
        )
        assert status == 200, body
        assert (body["strategy"], body["locality_weight"], body["load_threshold"]) == (
            "kv_cost", 0.4, 0.8)  # fmt: skip
        assert "min_hit" not in body and headers["x-kvroute-dropped-fields"] == "min_hit"
        status, body, headers = await admin.call(
            "PATCH", "/v1/workloads/chat", json={"strategy": "least_load"}
        )
        assert status == 200 and body["strategy"] == "least_load" and body["load_threshold"] == 0.8
        assert "locality_weight" not in body
        assert headers["x-kvroute-dropped-fields"] == "locality_weight"
        status, body, _ = await admin.call("GET", "/v1/audit?limit=1")
        assert "kv_cost -> least_load" in body["entries"][0]["detail"]
        assert "locality_weight=0.4" in body["entries"][0]["detail"]
        status, body, _ = await admin.call(
            "PATCH", "/v1/workloads/chat", json={"strategy": "round_robin", "min_hit": 0.5}
        )
        assert status == 422 and "min_hit" in json.dumps(body["detail"])
        assert "round_robin" in json.dumps(body["detail"])


@sqlite_only
async def test_revisions_and_rollback(make_records: RecordsFactory) -> None:
    records = await make_records()
    async with admin_client(records) as admin:
        await admin.call(
            "PUT", "/v1/workloads/rag", json={"strategy": "prefix_hash", "prefix_tokens": 128}
        )
        await admin.call("PATCH", "/v1/workloads/rag", json={"prefix_tokens": 512})
        status, body, _ = await admin.call("GET", "/v1/workloads/rag/revisions")
        first = body["revisions"][-1]
        assert [r["action"] for r in body["revisions"]] == ["patch", "put"]
        assert body["revisions"][0]["before"]["prefix_tokens"] == 128

        status, body, _ = await admin.call(
            "POST", "/v1/workloads/rag/rollback", json={"revision": first["revision"]}
        )
        assert status == 200 and body["prefix_tokens"] == 128
        status, body, _ = await admin.call("GET", "/v1/workloads/rag")
        assert body["prefix_tokens"] == 128
        status, _, _ = await admin.call(
            "POST", "/v1/workloads/rag/rollback", json={"revision": 10**9}
        )
        assert status == 404


@sqlite_only
async def test_replicas_drain_residency_and_explain(make_records: RecordsFactory) -> None:
    fleet = InTestFleet(
        [
            replica_info("r0", prefix_cache_queries=1000, prefix_cache_hits=250),
            replica_info("r1", running=3),
        ]
    )
    records = await make_records(fleet)
    request = {
        "model": "sim",
        "messages": [
            {"role": "system", "content": "You are a careful assistant. " * 40},
            {"role": "user", "content": "hello"},
        ],
    }
    tokens = prompt_token_ids(request, load_tokenizer("builtin"))
    keys = block_keys(tokens, model="kvroute/sim-model", block_size=16)
    fleet.hold("r1", keys)
    fleet.hold("r0", keys[:2])
    async with admin_client(records) as admin:
        status, body, _ = await admin.call("GET", "/v1/replicas")
        assert status == 200
        rows = {r["replica_id"]: r for r in body["replicas"]}
        assert rows["r0"]["hit_rate"] == 0.25 and rows["r1"]["running"] == 3
        assert body["state"] == {"epoch": 7, "version": 42}  # what proxies must hold of it

        assert (await admin.call("POST", "/v1/replicas/r0/drain"))[1]["draining"] is True
        assert fleet.infos["r0"].draining
        assert (await admin.call("POST", "/v1/replicas/r0/undrain"))[1]["draining"] is False
        assert (await admin.call("POST", "/v1/replicas/r9/drain"))[0] == 404
        _, audit, _ = await admin.call("GET", "/v1/audit?limit=10")
        replica_entries = [
            (e["action"], e["target"])
            for e in audit["entries"]
            if e["target"].startswith("replica/")
        ]  # committed by the service: both flips, newest first, the refused id not at all
        assert replica_entries == [("undrain", "replica/r0"), ("drain", "replica/r0")]

        status, body, _ = await admin.call("GET", "/v1/residency?top=1")
        assert body["total_keys"] == len(keys)
        assert body["per_replica"] == {"r0": 2, "r1": len(keys)}
        assert body["most_shared"] == [{"key": f"{min(keys[:2]):016x}", "holders": ["r0", "r1"]}]

        model = {"model": "kvroute/sim-model", "served_names": ["sim"], "block_size": 16}
        assert (await admin.call("PUT", "/v1/models/sim-model", json=model))[0] == 201
        await until(records, lambda: "sim-model" in records.store.models())
        status, body, _ = await admin.call("POST", "/v1/route/explain", json={"request": request})
        assert status == 200, body
        assert body["workload"] == "default" and body["blocks"] == len(keys)
        decision = body["decision"]
        assert decision["replica_id"] == "r1" and decision["strategy"] == "kv_cost"
        reasons = {r["replica_id"]: r for r in decision["replicas"]}
        assert reasons["r1"]["hit_blocks"] == len(keys)
        # the default weighs time: each candidate's wait, prefill and prefill rate
        assert reasons["r0"]["prefill_s"] > reasons["r1"]["prefill_s"] >= 0
        assert reasons["r1"]["wait_s"] == 0 and reasons["r1"]["prefill_tokens_per_s"] > 0

        # a cache_salt keys the prompt apart, as the proxy does: nobody holds it
        salted = {"request": {**request, "cache_salt": "tenant-b"}}
        status, body, _ = await admin.call("POST", "/v1/route/explain", json=salted)
        assert status == 200
        assert all(r.get("hit_blocks", 0) == 0 for r in body["decision"]["replicas"])

        # a LoRA adapter (r0 announces it): keyed under it, only its holder offered
        fleet.infos["r0"].lora_adapters["sql"] = "/adapters/sql"
        fleet.hold("r0", block_keys(tokens, model="kvroute/sim-model", lora_name="sql"))
        adapter = {"request": {**request, "model": "sql"}}
        status, body, _ = await admin.call("POST", "/v1/route/explain", json=adapter)
        assert status == 200 and body["lora_adapter"] == "sql"
        reasons = {r["replica_id"]: r for r in body["decision"]["replicas"]}
        assert body["decision"]["replica_id"] == "r0"
        assert reasons["r0"]["hit_blocks"] == len(keys)
        assert "does not serve model 'sql'" in json.dumps(reasons["r1"])

        status, body, _ = await admin.call(
            "POST", "/v1/route/explain", json={"request": {"model": "sim"}}
        )
        assert status == 422 and "messages" in json.dumps(body["detail"])
        # a prompt the model's tokenizer refuses is routed, as the proxy routes it: no keys
        developer = {"model": "sim", "messages": [{"role": "developer", "content": "Hi"}]}
        status, body, _ = await admin.call("POST", "/v1/route/explain", json={"request": developer})
        assert status == 200 and (body["prompt_tokens"], body["blocks"]) == (0, 0)
        assert "refuses this prompt" in body["note"] and body["decision"]["replica_id"]
        status, body, _ = await admin.call(
            "POST", "/v1/route/explain", json={"request": request, "workload": "nope"}
        )
        assert status == 422 and "workload" in json.dumps(body["detail"])


@sqlite_only
async def test_admin_calls_are_traced_and_counted(
    etcd: aetcd.Client, database_url: str, etcd_prefix: str
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = make_settings(database_url, etcd_prefix)
    records = Records(settings, etcd, InTestFleet(), CollectorRegistry(), tracer_provider=provider)
    await records.start()
    try:
        async with admin_client(records) as admin:
            assert (await admin.call("GET", "/v1/workloads/default"))[0] == 200
            assert (await admin.as_token(None).call("GET", "/v1/workloads/default"))[0] == 401
            _, metrics, _ = await admin.call("GET", "/metrics")
    finally:
        await records.aclose()
    spans = [s for s in exporter.get_finished_spans() if s.name == "GET /v1/workloads/{name}"]
    assert [s.attributes["http.response.status_code"] for s in spans] == [200, 401]
    assert (
        'kvroute_controlplane_admin_requests_total{method="GET",route="/v1/workloads/{name}",'
        'status="401"} 1.0' in metrics
    )
