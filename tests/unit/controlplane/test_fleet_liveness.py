"""Liveness from evidence about a replica, not from the bus's silence: silent replicas
are downed only when their silence says something about them; otherwise they are kept,
residency and all, and flagged stale."""

from __future__ import annotations

from controlplane.fleet.fleet import Fleet, ReplicaRecord
from controlplane.fleet.fleet_view import LiveFleetView, replica_pb
from kvcore.pb import routing_pb2
from tests.unit.controlplane.support import announce, batch, load

TIMEOUT_S = 5.0


def fleet_of(*replicas: str, resyncs: list[tuple[str, str]] | None = None) -> Fleet:
    """Replicas announced and holding one key each (the replica's number) at time 0."""

    def asked(record: ReplicaRecord, reason: str, snapshot_id: int) -> None:
        if resyncs is not None:
            resyncs.append((record.replica_id, reason))

    fleet = Fleet(heartbeat_timeout_s=TIMEOUT_S, resync_retry_s=0.0, resync=asked)
    for replica in replicas:
        fleet.on_announce(announce(replica), now=0.0)
        fleet.on_batch(batch(0, stored=[[int(replica[1:])]], replica=replica), "default", 0.0)
    return fleet


def statuses(fleet: Fleet) -> dict[str, tuple[str, bool]]:
    return {r.replica_id: (r.status, r.stale) for r in LiveFleetView(fleet).replicas()}


def test_while_its_own_link_is_down_the_control_plane_downs_nobody() -> None:
    fleet = fleet_of("r1", "r2", "r3")
    assert fleet.expire(now=60.0, heard_since=None) == []
    assert statuses(fleet) == {r: ("healthy", True) for r in ("r1", "r2", "r3")}
    assert fleet.index.key_count() == 3  # residency kept: proxies route on it
    assert fleet.stale_count() == 3


def test_silence_counts_only_from_when_the_link_came_back() -> None:
    fleet = fleet_of("r1", "r2", "r3")
    fleet.expire(now=30.0, heard_since=None)
    assert fleet.expire(now=34.0, heard_since=30.0) == []  # back 4 s ago: no evidence yet
    fleet.on_load(load("r1"), "default", now=30.5)
    fleet.on_load(load("r2"), "default", now=30.5)
    assert statuses(fleet)["r1"] == ("healthy", False)  # heard from again: not stale
    fleet.on_load(load("r1"), "default", now=35.0)  # and go on reporting
    fleet.on_load(load("r2"), "default", now=35.0)
    gone = fleet.expire(now=35.5, heard_since=30.0)  # r3 silent 5.5 s with the link up
    assert [r.replica_id for r in gone] == ["r3"]
    assert statuses(fleet)["r3"] == ("down", False)


def test_more_than_the_panic_threshold_silent_together_is_kept_stale() -> None:
    fleet = fleet_of("r1", "r2", "r3", "r4")
    fleet.on_load(load("r4"), "default", now=4.0)
    assert fleet.expire(now=6.0) == []  # three of four silent: the bus, not the fleet
    assert [r for r, (_, stale) in statuses(fleet).items() if stale] == ["r1", "r2", "r3"]
    fleet.on_load(load("r3"), "default", now=6.5)
    fleet.on_load(load("r4"), "default", now=6.5)
    gone = fleet.expire(now=7.0)  # two of four: at the threshold, evidence about them
    assert sorted(r.replica_id for r in gone) == ["r1", "r2"]
    for record in gone:
        list(fleet.drop_steps(record, chunk=10))
    assert fleet.index.key_count() == 2 and fleet.stale_count() == 0


def test_replicas_falling_silent_a_sweep_apart_are_silent_together() -> None:
    """Their last reports 0.4 s apart (a NATS partition of the sidecars): the sweep that
    finds the first past the timeout finds the others past half of it, and downs none
    (it downed the first, the panic threshold not yet reached, and kept only the rest)."""
    fleet = fleet_of("r1", "r2", "r3")
    fleet.on_load(load("r2"), "default", now=0.4)
    fleet.on_load(load("r3"), "default", now=0.8)
    assert fleet.expire(now=5.2) == []  # r1 past the timeout, r2 and r3 past half of it
    assert statuses(fleet)["r1"] == ("healthy", True)
    assert fleet.expire(now=6.0) == [] and fleet.stale_count() == 3
    assert fleet.index.key_count() == 3


def test_a_replica_silent_alone_is_downed_though_others_were_late() -> None:
    fleet = fleet_of("r1", "r2", "r3", "r4")
    fleet.on_load(load("r2"), "default", now=3.0)
    fleet.on_load(load("r3"), "default", now=5.0)
    fleet.on_load(load("r4"), "default", now=5.0)
    gone = fleet.expire(now=5.6)  # r1 past the timeout, r2 past half: two of four, not more
    assert [r.replica_id for r in gone] == ["r1"]


def test_a_threshold_of_one_turns_the_panic_guard_off() -> None:
    fleet = fleet_of("r1", "r2")
    fleet.panic_threshold = 1.0
    assert len(fleet.expire(now=6.0)) == 2


def test_a_load_report_brings_a_down_replica_back_and_asks_for_its_state() -> None:
    resyncs: list[tuple[str, str]] = []
    fleet = fleet_of("r1", "r2", resyncs=resyncs)
    fleet.on_load(load("r2"), "default", now=6.0)
    assert [r.replica_id for r in fleet.expire(now=6.0)] == ["r1"]
    fleet.changes.take()
    fleet.on_load(load("r1"), "default", now=7.0)
    assert statuses(fleet)["r1"] == ("healthy", False)
    assert resyncs[-1] == ("r1", "unknown stream")
    replicas = fleet.changes.take().replicas  # the proxies hear it in the next delta
    assert fleet.by_id["r1"].ordinal in replicas


def test_after_the_link_returns_every_live_replica_is_asked_for_its_state() -> None:
    resyncs: list[tuple[str, str]] = []
    fleet = fleet_of("r1", "r2", "r3", resyncs=resyncs)
    fleet.on_load(load("r2"), "default", now=6.0)
    fleet.on_load(load("r3"), "default", now=6.0)
    fleet.expire(now=6.0)  # r1 down: nobody to ask
    resyncs.clear()
    fleet.resync_all("nats reconnected")
    assert resyncs == [("r2", "nats reconnected"), ("r3", "nats reconnected")]


def test_proxies_see_a_stale_replica_as_healthy() -> None:
    fleet = fleet_of("r1")
    fleet.expire(now=60.0, heard_since=None)
    assert replica_pb(fleet.by_id["r1"]).status == routing_pb2.REPLICA_STATUS_HEALTHY
