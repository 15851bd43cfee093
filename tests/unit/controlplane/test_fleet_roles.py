"""A replica's P/D role, as its sidecar announced it, reaches the admin API's
``/v1/replicas`` and the proxies' endpoints; a sidecar that says nothing is ``both``."""

from __future__ import annotations

from controlplane.fleet.fleet import Fleet
from controlplane.fleet.fleet_view import LiveFleetView, replica_pb
from dataplane.endpoints import endpoint_of
from kvcore.pb import events_pb2
from tests.unit.controlplane.support import announce


def fleet_with_roles() -> Fleet:
    fleet = Fleet(heartbeat_timeout_s=5.0, resync_retry_s=0.0)
    prefill = announce("p1")
    prefill.role, prefill.bootstrap_port = events_pb2.REPLICA_ROLE_PREFILL, 8998
    decode = announce("d1")
    decode.role = events_pb2.REPLICA_ROLE_DECODE
    for message in (prefill, decode, announce("b1")):
        fleet.on_announce(message, now=0.0)
    return fleet


def test_replicas_listing_shows_each_role_and_the_bootstrap_port() -> None:
    listed = {
        r.replica_id: (r.role, r.bootstrap_port)
        for r in LiveFleetView(fleet_with_roles()).replicas()
    }
    assert listed == {"p1": ("prefill", 8998), "d1": ("decode", 0), "b1": ("both", 0)}


def test_proxies_receive_the_roles_in_their_endpoints() -> None:
    fleet = fleet_with_roles()
    endpoints = {rid: endpoint_of(replica_pb(fleet.by_id[rid])) for rid in ("p1", "d1", "b1")}
    assert {rid: e.role for rid, e in endpoints.items()} == {
        "p1": "prefill",
        "d1": "decode",
        "b1": "both",
    }
    assert endpoints["p1"].bootstrap_port == 8998
