"""Subjects and etcd keys: built in one place, and ids that would misroute are refused."""

from __future__ import annotations

import pytest

from kvcore import subjects
from kvcore.subjects import EtcdKeys, InvalidName, SubjectKind


def test_subjects_follow_the_documented_layout() -> None:
    assert subjects.announce_subject("default") == "kvroute.v1.announce.default"
    assert subjects.events_subject("default", "vllm-0") == "kvroute.v1.events.default.vllm-0"
    assert subjects.load_subject("p_1", "r") == "kvroute.v1.load.p_1.r"
    assert subjects.resync_subject("p", "r") == "kvroute.v1.resync.p.r"


@pytest.mark.parametrize("bad", ["", "a.b", "a*", ">", "a b", "a/b", "ü", "x" * 129])
def test_ids_that_would_change_a_subjects_meaning_are_refused(bad: str) -> None:
    with pytest.raises(InvalidName, match="replica"):
        subjects.events_subject("default", bad)
    with pytest.raises(InvalidName, match="pool"):
        subjects.announce_subject(bad)


def test_parse_round_trips_every_subject_kind() -> None:
    parsed = subjects.parse_subject(subjects.load_subject("gpu-a", "r7"))
    assert (parsed.kind, parsed.pool, parsed.replica) == (SubjectKind.LOAD, "gpu-a", "r7")
    announce = subjects.parse_subject(subjects.announce_subject("gpu-a"))
    assert (announce.kind, announce.replica) == (SubjectKind.ANNOUNCE, None)


@pytest.mark.parametrize(
    "bad",
    ["other.v1.events.p.r", "kvroute.v1.events.p", "kvroute.v1.nope.p.r", "kvroute.v1.load.p.r.x"],
)
def test_parse_rejects_foreign_or_malformed_subjects(bad: str) -> None:
    with pytest.raises(InvalidName):
        subjects.parse_subject(bad)


def test_pool_subscriptions_cover_exactly_that_pools_subjects() -> None:
    subs = subjects.pool_subscriptions("a")
    assert "kvroute.v1.announce.a" in subs
    assert "kvroute.v1.events.a.*" in subs and "kvroute.v1.load.a.*" in subs
    assert not any("resync" in s for s in subs)
    assert all(s.endswith(".>") for s in subjects.pool_subscriptions(None))


def test_etcd_keys_live_below_the_configured_prefix() -> None:
    keys = EtcdKeys()
    assert keys.workload("chat") == "/kvroute/v1/workloads/chat"
    assert keys.replica("default", "r1") == "/kvroute/v1/pools/default/replicas/r1"
    assert keys.shard_leader("all") == "/kvroute/v1/shards/all/leader"
    assert keys.pool_shard("default") == "/kvroute/v1/pools/default/shard"
    assert keys.model("llama-8b") == "/kvroute/v1/models/llama-8b"
    assert keys.rules() == "/kvroute/v1/rules"
    assert keys.api_key("k1") == "/kvroute/v1/api-keys/k1"
    assert keys.name_in(keys.model("m"), keys.models_prefix()) == "m"
    custom = EtcdKeys("/team-a/kv/")
    assert custom.workload("x").startswith("/team-a/kv/workloads/")
    assert custom.name_in(custom.workload("x"), custom.workloads_prefix()) == "x"
    with pytest.raises(InvalidName):
        EtcdKeys("no-slashes")
    with pytest.raises(InvalidName):
        keys.workload("../etc")


def test_drain_keys_round_trip_and_refuse_foreign_keys() -> None:
    keys = EtcdKeys()
    key = keys.replica_drain("default", "r1")
    assert key == "/kvroute/v1/draining/default/r1"
    assert keys.drain_parts(key) == ("default", "r1")
    for bad in ("/kvroute/v1/draining/default", "/kvroute/v1/pools/default/replicas/r1"):
        with pytest.raises(InvalidName):
            keys.drain_parts(bad)
