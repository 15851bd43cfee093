"""A server's listening socket: its announced URL, and a port in use refused."""

from __future__ import annotations

import pytest

from kvruntime.sockets import bind_tcp, url_of


def test_port_0_is_announced_as_the_port_bound() -> None:
    with bind_tcp("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0 and url_of(sock, "https") == f"https://127.0.0.1:{port}"


def test_a_port_another_server_listens_on_is_refused() -> None:
    with bind_tcp("127.0.0.1", 0) as first:
        first.listen()
        with pytest.raises(OSError):
            bind_tcp("127.0.0.1", first.getsockname()[1])
