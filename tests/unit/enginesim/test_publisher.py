"""The ZMQ transport on real loopback sockets: live frames, replay, faults."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from enginesim.publisher import END_SEQ, EventPublisher, PublisherConfig

TIMEOUT_MS = 5000


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    pub = EventPublisher(
        PublisherConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv@t", buffer_steps=4)
    )
    pub.start()
    yield pub
    pub.close()


class Sockets:
    """Creates client sockets and closes every one of them at teardown."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.opened: list[zmq.Socket] = []

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        self.opened.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.opened:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def ctx() -> Iterator[Sockets]:
    sockets = Sockets()
    yield sockets
    sockets.close()


def subscribe(ctx: Sockets, pub: EventPublisher) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.connect(pub.endpoint)
    return sub


def connected_subscriber(ctx: Sockets, pub: EventPublisher) -> zmq.Socket:
    """A SUB that provably receives: publish probes until one arrives (slow joiner)."""
    sub = subscribe(ctx, pub)
    sub.setsockopt(zmq.RCVTIMEO, 50)
    for _ in range(200):
        pub.publish(b"probe")
        try:
            sub.recv_multipart()
            break
        except zmq.Again:
            continue
    else:
        raise AssertionError("subscriber never connected")
    drain(sub)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    return sub


def drain(sub: zmq.Socket) -> None:
    while sub.poll(100):
        sub.recv_multipart()


def replay(ctx: Sockets, pub: EventPublisher, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    assert pub.replay_endpoint is not None
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    while True:
        frames = dealer.recv_multipart()
        replies.append(frames)
        if frames[2] == END_SEQ:
            return replies


def test_live_frames_are_topic_seq_payload(ctx: Sockets, publisher: EventPublisher) -> None:
    sub = connected_subscriber(ctx, publisher)
    publisher.publish(b"one")
    publisher.publish(b"two")
    first, second = sub.recv_multipart(), sub.recv_multipart()
    assert first[0] == b"kv@t" and first[2] == b"one"
    assert int.from_bytes(second[1], "big") == int.from_bytes(first[1], "big") + 1
    assert len(first[1]) == 8 and second[2] == b"two"


def test_paused_batches_are_a_gap_that_replay_fills(
    ctx: Sockets, publisher: EventPublisher
) -> None:
    sub = connected_subscriber(ctx, publisher)
    publisher.publish(b"a")
    seq_a = int.from_bytes(sub.recv_multipart()[1], "big")
    publisher.command("pause")
    publisher.publish(b"b")
    publisher.publish(b"c")
    publisher.command("resume")
    publisher.publish(b"d")
    live = sub.recv_multipart()
    assert live[2] == b"d" and int.from_bytes(live[1], "big") == seq_a + 3
    replies = replay(ctx, publisher, seq_a + 1)
    assert replies == [
        [b"", b"kv@t", (seq_a + 1).to_bytes(8, "big"), b"b"],
        [b"", b"kv@t", (seq_a + 2).to_bytes(8, "big"), b"c"],
        [b"", b"kv@t", (seq_a + 3).to_bytes(8, "big"), b"d"],
        [b"", b"", END_SEQ, b""],
    ]


def test_replay_buffer_is_bounded(ctx: Sockets, publisher: EventPublisher) -> None:
    for i in range(10):
        publisher.publish(str(i).encode())
    replies = replay(ctx, publisher, 0)
    assert [r[3] for r in replies[:-1]] == [b"6", b"7", b"8", b"9"]


def test_restart_resets_seq_and_drops_replay(ctx: Sockets, publisher: EventPublisher) -> None:
    sub = connected_subscriber(ctx, publisher)
    publisher.publish(b"x")
    assert int.from_bytes(sub.recv_multipart()[1], "big") > 0
    publisher.command("restart")
    publisher.publish(b"y")
    assert sub.recv_multipart()[1:] == [(0).to_bytes(8, "big"), b"y"]
    publisher.command("drop_replay")
    assert replay(ctx, publisher, 0) == [[b"", b"", END_SEQ, b""]]


def test_malformed_replay_requests_are_ignored(ctx: Sockets, publisher: EventPublisher) -> None:
    publisher.publish(b"kept")
    bad = ctx.socket(zmq.DEALER)
    assert publisher.replay_endpoint is not None
    bad.connect(publisher.replay_endpoint)
    bad.send_multipart([b"", b"short"])
    bad.send_multipart([b"no-delimiter"])
    assert [r[3] for r in replay(ctx, publisher, 0)[:-1]][-1] == b"kept"


def test_busy_endpoint_fails_at_start(publisher: EventPublisher) -> None:
    clash = EventPublisher(PublisherConfig(publisher.endpoint, None))
    with pytest.raises(zmq.ZMQError):
        clash.start()
    clash.close()
