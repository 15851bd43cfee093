"""NATS connection options from the settings: servers, credentials, TLS.

Secrets go straight from the settings' ``SecretStr`` into nats-py;
:func:`kvruntime.nats.redacted` is what logs may show of a URL.
"""

from __future__ import annotations

import ssl
from typing import Any

from controlplane.settings import ControlPlaneSettings


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
