"""kvroute.servers: starting and stopping real servers is clean and failures are explained."""

from __future__ import annotations

import socket

import pytest

from kvroute.servers import NatsServer, ServerStartError

pytestmark = pytest.mark.integration


def test_servers_stop_cleanly_and_give_their_port_back() -> None:
    # pytest runs with warnings as errors: a reader thread failing on a closed pipe at
    # stop() would fail this test as an unhandled thread exception.
    for _ in range(15):
        server = NatsServer().start()
        assert server.running
        server.stop()
        assert not server.running
        assert not server.workdir.exists()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", server.port))


def test_a_server_that_cannot_start_says_why(nats_server: NatsServer) -> None:
    clash = NatsServer()
    clash.port = nats_server.port  # already taken by the running fixture
    with pytest.raises(ServerStartError, match=r"nats did not become ready \(exited with"):
        clash.start()
    assert not clash.running
