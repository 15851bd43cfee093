"""Builders of sidecar messages for control-plane tests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcore.pb import events_pb2

KeyRuns = Sequence[Sequence[int]]


def batch(
    seq: int,
    *,
    epoch: int = 1,
    stored: KeyRuns = (),
    removed: Sequence[int] = (),
    cleared: bool = False,
    snapshot: bool = False,
    done: bool = False,
    snapshot_id: int = 0,
    replica: str = "r1",
    pool: str = "default",
    medium: events_pb2.Medium = events_pb2.MEDIUM_GPU,
) -> events_pb2.KvEventBatch:
    msg = events_pb2.KvEventBatch(
        replica_id=replica,
        pool=pool,
        epoch=epoch,
        seq=seq,
        snapshot=snapshot,
        snapshot_done=done,
        snapshot_id=snapshot_id,
    )
    if cleared:
        msg.events.add().cleared.SetInParent()
    for run in stored:
        msg.events.add().stored.CopyFrom(events_pb2.BlocksStored(keys=run, medium=medium))
    if removed:
        msg.events.add().removed.CopyFrom(events_pb2.BlocksRemoved(keys=removed, medium=medium))
    return msg


def snapshot_parts(
    first_seq: int,
    parts: Iterable[Sequence[int]],
    *,
    epoch: int = 1,
    snapshot_id: int = 0,
    replica: str = "r1",
    pool: str = "default",
) -> list[events_pb2.KvEventBatch]:
    runs = list(parts)
    return [
        batch(
            first_seq + i,
            epoch=epoch,
            stored=[run],
            snapshot=True,
            done=i == len(runs) - 1,
            snapshot_id=snapshot_id,
            replica=replica,
            pool=pool,
        )
        for i, run in enumerate(runs)
    ]


def announce(
    replica: str = "r1",
    *,
    pool: str = "default",
    epoch: int = 1,
    model: str = "m",
    incomplete: bool = False,
) -> events_pb2.ReplicaAnnounce:
    return events_pb2.ReplicaAnnounce(
        replica_id=replica,
        pool=pool,
        base_url=f"http://127.0.0.1:1/{replica}",
        model=model,
        served_names=[model],
        engine_kind=events_pb2.ENGINE_KIND_VLLM,
        block_size=16,
        sidecar_epoch=epoch,
        state_incomplete=incomplete,
    )


def load(
    replica: str = "r1", *, pool: str = "default", running: int = 1, waiting: int = 2
) -> events_pb2.LoadReport:
    return events_pb2.LoadReport(
        replica_id=replica,
        pool=pool,
        running=running,
        waiting=waiting,
        kv_usage=0.25,
        engine_up=True,
    )
