"""The listening sockets kvroute's servers bind before they serve, and the URLs they
announce.

A server binds its socket itself, before its event loop serves it, so that a port in
use is refused at start-up in the server's own words, and port 0 yields the real port
for the ready line. IPv4 or IPv6 follows the host's form; ``SO_REUSEADDR`` lets a
restarted server bind at once; ``SO_REUSEPORT`` lets the proxy's workers share a port.
"""

from __future__ import annotations

import socket


def bind_tcp(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening); ``OSError`` if it cannot
    be bound, the socket closed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket, scheme: str = "http") -> str:
    """``scheme://host:port`` of a bound socket (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
