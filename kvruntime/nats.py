"""What every NATS client of kvroute needs beside nats-py: a wait until its subscriptions
are live on the server, and URLs fit for a log line.

The sidecar (which answers resync requests) and the control plane (which receives every
event) both subscribe and then rely on seeing what is sent right after; both log the URL
they connect to, which may embed a password or token.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import nats.errors
from nats.aio.client import Client


async def subscriptions_live(nc: Client, timeout_s: float = 5.0) -> bool:
    """Wait until the server holds every subscription made so far on ``nc``; ``False``
    if that could not be seen within ``timeout_s`` (a server that forbids publishing to
    ``_INBOX.>``, say: the subscriptions then go live a moment later, as before).

    nats-py's ``flush()`` writes its PING ahead of the SUBs still queued for its flusher
    (2.16), so its PONG does not prove they reached the server, and a message published
    meanwhile from another connection is lost (a request finds no responder). A message
    to a fresh inbox of ours, queued after them, does prove it: the server handles one
    connection's commands in order.
    """
    probe = await nc.subscribe(nc.new_inbox(), max_msgs=1)
    await nc.publish(probe.subject, b"")
    try:
        await probe.next_msg(timeout=timeout_s)
    except nats.errors.TimeoutError:
        await probe.unsubscribe()
        return False
    return True


def redacted(url: str) -> str:
    """``url`` (or a comma-separated list) without any embedded user, password or token."""
    return ",".join(_redact_one(part) for part in url.split(","))


def _redact_one(url: str) -> str:
    parts = urlsplit(url.strip())
    if "@" not in parts.netloc:
        return url.strip()
    host = parts.hostname or ""
    netloc = f"***@{host}:{parts.port}" if parts.port else f"***@{host}"
    return urlunsplit(parts._replace(netloc=netloc))
