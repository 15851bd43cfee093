"""``free_port`` hands out ports no outgoing connection can take before the server binds."""

from __future__ import annotations

import socket
from pathlib import Path

from kvroute.servers import free_port


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert all(10_000 <= port < low for port in ports), sorted(ports)
    assert len(ports) > 40, "free_port keeps handing out the same few ports"
    with socket.socket() as sock:
        port = free_port()
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_a_port_in_use_is_never_handed_out() -> None:
    held: list[socket.socket] = []
    try:
        for _ in range(200):  # hold what it hands out: each next one must be another
            sock = socket.socket()
            sock.bind(("127.0.0.1", free_port()))
            sock.listen()
            held.append(sock)
        assert len({s.getsockname()[1] for s in held}) == 200
    finally:
        for sock in held:
            sock.close()


def test_a_port_promised_to_another_server_is_never_handed_out() -> None:
    # kvroute up promises --port, --port+1, ... to its proxies, started last: the ports it
    # picks for NATS, etcd and the sidecars before them must not be among those
    low, _ = _ephemeral_range()
    promised = range(10_000, (10_000 + low) // 2)
    ports = [free_port(promised) for _ in range(100)]
    assert not [port for port in ports if port in promised], sorted(ports)
    assert all(port < low for port in ports)  # still below the ephemeral range
    assert free_port(range(1, low)) >= low  # nothing below it left: the kernel's choice
