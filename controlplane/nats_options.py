"""NATS connection options from the settings: servers, credentials, TLS; and a wait until
subscriptions are live on the server.

Secrets go straight from the settings' ``SecretStr`` into nats-py; :func:`redacted` is
what logs may show of a URL.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats.errors
from nats.aio.client import Client

from controlplane.settings import ControlPlaneSettings


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


def connect_options(settings: ControlPlaneSettings) -> dict[str, Any]:
    options: dict[str, Any] = {
        "servers": [url.strip() for url in settings.nats_url.split(",") if url.strip()],
        "name": f"kvroute-controlplane-{settings.instance_id}",
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 2,
        "allow_reconnect": True,
    }
    if settings.nats_user is not None:
        options["user"] = settings.nats_user
        options["password"] = settings.secret("nats_password")
    if settings.nats_token is not None:
        options["token"] = settings.secret("nats_token")
    if settings.nats_creds_file is not None:
        options["user_credentials"] = str(settings.nats_creds_file)
    context = tls_context(settings)
    if context is not None:
        options["tls"] = context
    return options


def tls_context(settings: ControlPlaneSettings) -> ssl.SSLContext | None:
    wants_tls = settings.nats_url.startswith("tls://") or settings.nats_tls_ca is not None
    if not wants_tls and settings.nats_tls_cert is None:
        return None
    cafile = str(settings.nats_tls_ca) if settings.nats_tls_ca is not None else None
    context = ssl.create_default_context(cafile=cafile)
    if settings.nats_tls_cert is not None and settings.nats_tls_key is not None:
        context.load_cert_chain(str(settings.nats_tls_cert), str(settings.nats_tls_key))
    return context


async def subscriptions_live(nc: Client, timeout_s: float = 5.0) -> bool:
    """Wait until the server holds every subscription made so far on ``nc``; ``False``
    if that could not be seen within ``timeout_s`` (a server that forbids publishing to
    ``_INBOX.>``, say: the subscriptions then go live a moment later, as before).

    nats-py's ``flush()`` writes its PING ahead of the SUBs still queued for its flusher
    (2.16), so its PONG does not prove they reached the server, and a message published
    meanwhile from another connection is lost. A message to a fresh inbox of ours, queued
    after them, does prove it: the server handles one connection's commands in order.
    """
    probe = await nc.subscribe(nc.new_inbox(), max_msgs=1)
    await nc.publish(probe.subject, b"")
    try:
        await probe.next_msg(timeout=timeout_s)
    except nats.errors.TimeoutError:
        await probe.unsubscribe()
        return False
    return True
