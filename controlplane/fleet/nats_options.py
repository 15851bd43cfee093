"""NATS connection options from the settings: servers, credentials, TLS.

Secrets go straight from the settings' ``SecretStr`` into nats-py;
:func:`kvruntime.nats.redacted` is what logs may show of a URL.

The link is pinged often enough that a silent one (a partition: no reset, no bytes) is
found dead within :data:`LINK_DEAD_SHARE` of ``--heartbeat-timeout-s``, before any
replica can have been silent that long: the ingest then knows it is the one not hearing
and downs nobody (nats-py's default, a ping every 2 min, took up to 6 min).
"""

from __future__ import annotations

import ssl
from typing import Any

from controlplane.settings import ControlPlaneSettings

MAX_OUTSTANDING_PINGS = 2  # unanswered pings tolerated: the third tick declares it dead
LINK_DEAD_SHARE = 0.6  # of the heartbeat timeout: a silent link is dead by then


def connect_options(settings: ControlPlaneSettings) -> dict[str, Any]:
    options: dict[str, Any] = {
        "servers": [url.strip() for url in settings.nats_url.split(",") if url.strip()],
        "name": f"kvroute-controlplane-{settings.instance_id}",
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 2,
        "allow_reconnect": True,
        "ping_interval": ping_interval_s(settings),
        "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
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


def ping_interval_s(settings: ControlPlaneSettings) -> float:
    """A silent link is declared dead on the ping tick after :data:`MAX_OUTSTANDING_PINGS`
    went unanswered, at most ``MAX_OUTSTANDING_PINGS + 1`` intervals after it fell silent."""
    return settings.heartbeat_timeout_s * LINK_DEAD_SHARE / (MAX_OUTSTANDING_PINGS + 1)


def tls_context(settings: ControlPlaneSettings) -> ssl.SSLContext | None:
    wants_tls = settings.nats_url.startswith("tls://") or settings.nats_tls_ca is not None
    if not wants_tls and settings.nats_tls_cert is None:
        return None
    cafile = str(settings.nats_tls_ca) if settings.nats_tls_ca is not None else None
    context = ssl.create_default_context(cafile=cafile)
    if settings.nats_tls_cert is not None and settings.nats_tls_key is not None:
        context.load_cert_chain(str(settings.nats_tls_cert), str(settings.nats_tls_key))
    return context
