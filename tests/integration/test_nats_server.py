"""The nats_server fixture runs a real nats-server that carries kvroute's messages."""

from __future__ import annotations

import asyncio

import nats
import pytest

from kvcore import subjects
from kvcore.pb import events_pb2
from kvroute.servers import NatsServer
from kvruntime.nats import subscriptions_live

pytestmark = pytest.mark.integration


async def test_event_batch_published_on_replica_subject_reaches_pool_subscriber(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        received: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

        async def on_message(msg: nats.aio.msg.Msg) -> None:
            await received.put((msg.subject, msg.data))

        for subject in subjects.pool_subscriptions("pool-a"):
            await nc.subscribe(subject, cb=on_message)
        batch = events_pb2.KvEventBatch(replica_id="r1", pool="pool-a", epoch=7, seq=3)
        batch.events.add().stored.keys.extend([1, 2**64 - 1])
        await nc.publish(subjects.events_subject("pool-b", "r1"), b"other pool")
        await nc.publish(subjects.events_subject("pool-a", "r1"), batch.SerializeToString())
        await nc.flush()

        subject, data = await asyncio.wait_for(received.get(), timeout=30)
        assert subject == "kvroute.v1.events.pool-a.r1"
        decoded = events_pb2.KvEventBatch.FromString(data)
        assert (decoded.seq, list(decoded.events[0].stored.keys)) == (3, [1, 2**64 - 1])
        assert received.empty(), "a message for another pool reached this pool's subscription"
    finally:
        await nc.close()


async def test_resync_request_gets_the_sidecars_reply(nats_server: NatsServer) -> None:
    sidecar = await nats.connect(nats_server.url)
    controlplane = await nats.connect(nats_server.url)
    try:

        async def answer(msg: nats.aio.msg.Msg) -> None:
            request = events_pb2.ResyncRequest.FromString(msg.data)
            reply = events_pb2.ResyncReply(accepted=True, epoch=request.snapshot_id + 1)
            await msg.respond(reply.SerializeToString())

        await sidecar.subscribe(subjects.resync_subject("default", "r9"), cb=answer)
        assert await subscriptions_live(sidecar, timeout_s=30)  # flush() does not prove it
        request = events_pb2.ResyncRequest(requester="cp-1", reason="gap", snapshot_id=41)
        msg = await controlplane.request(
            subjects.resync_subject("default", "r9"), request.SerializeToString(), timeout=30
        )
        reply = events_pb2.ResyncReply.FromString(msg.data)
        assert reply.accepted and reply.epoch == 42
    finally:
        await sidecar.close()
        await controlplane.close()
