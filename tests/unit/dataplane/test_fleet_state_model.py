"""FleetState against a reference model: any run of deltas leaves the proxy with exactly
the state a fresh snapshot of the control plane's fleet would give it."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.fleet.state import FleetState
from kvcore.pb import routing_pb2
from tests.unit.dataplane.state_messages import (
    DRAINING,
    HEALTHY,
    MODEL,
    UNHEALTHY,
    delta,
    load,
    replica,
    snapshot,
)

ORDINALS = st.integers(0, 5)
KEYS = st.lists(st.integers(1, 40), max_size=12)


@dataclass
class Fleet:
    """What the control plane holds: replicas and each one's keys."""

    replicas: dict[int, routing_pb2.Replica] = field(default_factory=dict)
    keys: dict[int, set[int]] = field(default_factory=dict)

    def apply(self, body: routing_pb2.Delta) -> None:
        for info in body.replicas_upserted:
            old = self.replicas.get(info.ordinal)
            if old is not None and old.replica_id != info.replica_id:
                self.keys.pop(info.ordinal, None)  # another replica took the ordinal
            elif old is not None and not info.HasField("load"):
                info.load.CopyFrom(old.load)  # a status change keeps the last load
            self.replicas[info.ordinal] = info
        for ordinal in body.replicas_removed:
            self.replicas.pop(ordinal, None)
            self.keys.pop(ordinal, None)
        for change in body.residency:
            if change.ordinal in self.replicas:
                held = set() if change.cleared else self.keys.get(change.ordinal, set())
                self.keys[change.ordinal] = (held | set(change.added)) - set(change.removed)
        for update in body.loads:
            if update.ordinal in self.replicas:
                self.replicas[update.ordinal].load.CopyFrom(update.load)

    def snapshot(self, version: int) -> list[routing_pb2.StateUpdate]:
        residency = {o: sorted(k) for o, k in self.keys.items() if k}
        return snapshot(1, version, list(self.replicas.values()), residency, chunks=2)


@st.composite
def deltas(draw: st.DrawFn) -> routing_pb2.Delta:
    upserts = [
        replica(
            o,
            replica_id=f"r{o}-{draw(st.integers(0, 1))}",  # sometimes a new replica at o
            status=draw(st.sampled_from([HEALTHY, HEALTHY, DRAINING, UNHEALTHY])),
        )
        for o in draw(st.lists(ORDINALS, max_size=2, unique=True))
    ]
    residency = [
        routing_pb2.ResidencyChange(
            ordinal=draw(ORDINALS),
            cleared=draw(st.booleans()),
            added=draw(KEYS),
            removed=draw(KEYS),
        )
        for _ in range(draw(st.integers(0, 3)))
    ]
    loads = [
        routing_pb2.LoadUpdate(ordinal=o, load=load(draw(st.integers(0, 9)), 0, ts=5.0))
        for o in draw(st.lists(ORDINALS, max_size=2, unique=True))
    ]
    removed = draw(st.lists(ORDINALS, max_size=1))
    return routing_pb2.Delta(
        replicas_upserted=upserts, replicas_removed=removed, residency=residency, loads=loads
    )


def observed(state: FleetState) -> tuple[object, ...]:
    """Everything routing can see: the offered replicas with their load, and every
    replica's keys (single-key lookups, so order does not matter)."""
    view = state.views.view(MODEL)
    replicas = [(r.ordinal, r.replica_id, r.running) for r in view.replicas()]
    holders = {k: view.leading_runs([k], now=None) for k in range(1, 41)}
    held = {k: sorted(runs) for k, runs in holders.items() if runs}
    endpoints = sorted((e.ordinal, e.replica_id) for e in state.replicas.endpoints())
    return replicas, held, endpoints


@settings(max_examples=40, deadline=None)
@given(st.lists(deltas(), max_size=8))
def test_deltas_leave_the_state_a_fresh_snapshot_would_give(
    bodies: list[routing_pb2.Delta],
) -> None:
    fleet = Fleet()
    fleet.apply(routing_pb2.Delta(replicas_upserted=[replica(0), replica(1)]))
    following = FleetState()
    for update in fleet.snapshot(1):
        following.apply(update)
    for version, body in enumerate(bodies, start=2):
        following.apply(delta(1, version, **_fields(body)))
        fleet.apply(body)
    fresh = FleetState()
    for update in fleet.snapshot(len(bodies) + 1):
        fresh.apply(update)
    assert observed(following) == observed(fresh)


def _fields(body: routing_pb2.Delta) -> dict[str, object]:
    copy = routing_pb2.Delta()
    copy.CopyFrom(body)  # the model keeps its own messages
    return {
        "replicas_upserted": list(copy.replicas_upserted),
        "replicas_removed": list(copy.replicas_removed),
        "residency": list(copy.residency),
        "loads": list(copy.loads),
    }
