"""Ingest without NATS: each message checked against its subject, however often it comes."""

from __future__ import annotations

from controlplane.fleet.fleet import Fleet
from controlplane.fleet.ingest import Ingest
from controlplane.settings import ControlPlaneSettings
from kvcore import subjects
from kvcore.pb import events_pb2


def ingest() -> Ingest:
    return Ingest(ControlPlaneSettings(pools=["p"]), Fleet(heartbeat_timeout_s=60.0))


def batch(replica: str, seq: int, *keys: int) -> bytes:
    message = events_pb2.KvEventBatch(replica_id=replica, pool="p", epoch=1, seq=seq)
    message.events.add().stored.keys.extend(keys)
    return message.SerializeToString()


def test_a_subject_that_is_not_kvroutes_is_counted_every_time() -> None:
    target = ingest()
    for _ in range(3):
        target.handle("kvroute.v1.events.p", batch("r1", 0, 1), 0.0)  # no replica token
    assert target.malformed["subject"] == 3
    assert not target.fleet.by_id


def test_ids_are_checked_against_a_subject_seen_before() -> None:
    target = ingest()
    subject = subjects.events_subject("p", "r1")
    target.handle(subject, batch("r1", 0, 1, 2), 0.0)
    target.handle(subject, batch("r2", 0, 3), 0.0)  # another replica's batch on r1's subject
    target.handle(subject, batch("r1", 1, 4), 0.0)
    assert target.malformed["events"] == 1
    record = target.fleet.by_id["r1"]
    assert set(target.fleet.index.keys_of(record.ordinal)) == {1, 2, 4}
    assert "r2" not in target.fleet.by_id
