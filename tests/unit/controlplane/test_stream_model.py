"""Model-based: whatever NATS loses or repeats, the fleet ends exactly where the sidecar is.

A model sidecar (per docs/architecture.md: contiguous seqs per epoch, new epochs from
seq 0 with a clear, snapshots on request and on its own) publishes through a lossy,
repeating channel into a :class:`Fleet`; the fleet's resync requests are answered when
the scenario says so. Two properties: with nothing lost, the fleet equals the sidecar
after every batch and never asks for a resync once it has seen seq 0; whatever is lost,
a fleet that believes it is exact is, as of the last batch it saw (so a loss is never
missed); and after any history, one reliable snapshot (and the resyncs it may still
take) makes them equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.fleet.fleet import Fleet, ReplicaRecord
from kvcore.pb import events_pb2
from tests.unit.controlplane.support import batch

KEYS = st.lists(st.integers(1, 40), min_size=1, max_size=6)
OPS: st.SearchStrategy[tuple[str, list[int]]] = st.one_of(
    st.tuples(st.just("store"), KEYS),
    st.tuples(st.just("remove"), KEYS),
    st.tuples(st.sampled_from(["clear", "restart", "snapshot", "answer"]), st.just([])),
)
FATES = st.sampled_from(["ok", "ok", "ok", "ok", "lost", "twice"])


@dataclass
class ModelSidecar:
    epoch: int = 1
    seq: int = 0
    held: set[int] = field(default_factory=set)
    # what the sidecar held once each batch was published: what "exact" must match
    states: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict)

    def _next(self, **kwargs: object) -> events_pb2.KvEventBatch:
        out = batch(self.seq, epoch=self.epoch, **kwargs)  # type: ignore[arg-type]
        self.seq += 1
        return out

    def act(self, op: str, keys: list[int]) -> list[events_pb2.KvEventBatch]:
        batches = self._act(op, keys)
        for b in batches:
            self.states[(b.epoch, b.seq)] = frozenset(self.held)
        return batches

    def _act(self, op: str, keys: list[int]) -> list[events_pb2.KvEventBatch]:
        if op == "store":
            self.held |= set(keys)
            return [self._next(stored=[keys])]
        if op == "remove":
            self.held -= set(keys)
            return [self._next(removed=keys)]
        if op == "clear":
            self.held.clear()
            return [self._next(cleared=True)]
        if op == "restart":  # the engine restarted: a new epoch whose seq 0 is a clear
            self.epoch, self.seq = self.epoch + 1, 0
            self.held.clear()
            return [self._next(cleared=True)]
        return self.snapshot(0)

    def snapshot(self, snapshot_id: int) -> list[events_pb2.KvEventBatch]:
        keys = sorted(self.held)
        parts = [keys[i : i + 5] for i in range(0, len(keys), 5)] or [[]]
        batches = [
            self._next(stored=[p] if p else [], snapshot=True, done=i == len(parts) - 1,
                       snapshot_id=snapshot_id)
            for i, p in enumerate(parts)
        ]  # fmt: skip
        for b in batches:
            self.states[(b.epoch, b.seq)] = frozenset(self.held)
        return batches


def assert_exact_means_exact(fleet: Fleet, sidecar: ModelSidecar) -> None:
    """A fleet that believes it mirrors the sidecar does, as of the last batch it saw."""
    record = fleet.by_id.get("r1")
    if record is None or record.held is not None:
        return
    stream = record.stream
    if stream.exact and stream.snapshot is None and stream.last_seq is not None:
        assert stream.epoch is not None
        assert held(fleet) == sidecar.states[(stream.epoch, stream.last_seq)]


class Asked:
    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, record: ReplicaRecord, reason: str, snapshot_id: int) -> None:
        self.ids.append(snapshot_id)


def held(fleet: Fleet) -> set[int]:
    record = fleet.by_id.get("r1")
    return set() if record is None else set(fleet.index.keys_of(record.ordinal))


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(OPS, max_size=30), repeats=st.lists(st.booleans(), max_size=60))
def test_with_nothing_lost_the_fleet_follows_exactly(
    ops: list[tuple[str, list[int]]], repeats: list[bool]
) -> None:
    sidecar, asked = ModelSidecar(), Asked()
    fleet = Fleet(heartbeat_timeout_s=5.0, resync_retry_s=0.0, resync=asked)
    n = 0
    for op, keys in ops:
        if op == "answer":
            continue
        for b in sidecar.act(op, keys):
            for _ in range(2 if n < len(repeats) and repeats[n] else 1):
                fleet.on_batch(b, "default", 0.0)
            n += 1
            if not b.snapshot or b.snapshot_done:
                assert held(fleet) == sidecar.held
    assert asked.ids == []


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(OPS, max_size=30), data=st.data())
def test_after_any_losses_one_snapshot_makes_the_fleet_exact(
    ops: list[tuple[str, list[int]]], data: st.DataObject
) -> None:
    sidecar, asked = ModelSidecar(), Asked()
    fleet = Fleet(heartbeat_timeout_s=5.0, resync_retry_s=0.0, resync=asked)

    def send(batches: list[events_pb2.KvEventBatch], *, reliable: bool = False) -> None:
        for b in batches:
            fate = "ok" if reliable else data.draw(FATES)
            for _ in range({"ok": 1, "lost": 0, "twice": 2}[fate]):
                fleet.on_batch(b, "default", 0.0)
                assert_exact_means_exact(fleet, sidecar)

    def answer(*, reliable: bool = False) -> None:
        """The sidecar answers the last request: a reply and a snapshot, the reply
        processed before the snapshot, after it, or never (then the wait times out)."""
        snapshot_id = asked.ids[-1]
        parts = sidecar.snapshot(snapshot_id)
        record = fleet.by_id["r1"]
        when = "before" if reliable else data.draw(st.sampled_from(["before", "after", "lost"]))
        if when == "before":
            fleet.on_resync_reply(record, snapshot_id, sidecar.epoch, parts[0].seq)
        send(parts, reliable=reliable)
        if when == "after":
            fleet.on_resync_reply(record, snapshot_id, sidecar.epoch, parts[0].seq)
        elif when == "lost":
            fleet.retry_resyncs()
        assert_exact_means_exact(fleet, sidecar)

    for op, keys in ops:
        if op == "answer":
            if asked.ids:
                answer()
            continue
        send(sidecar.act(op, keys))
    if "r1" not in fleet.by_id:
        return
    fleet.release(fleet.by_id["r1"], reply_lost=True)  # no reply pending any more
    send(sidecar.snapshot(0), reliable=True)
    for _ in range(3):  # the snapshot may not be placeable: answer the resync it caused
        if held(fleet) == sidecar.held and fleet.by_id["r1"].stream.exact:
            break
        assert asked.ids, "the fleet is not exact and asked for nothing"
        answer(reliable=True)
    assert held(fleet) == sidecar.held
    assert fleet.by_id["r1"].stream.exact
