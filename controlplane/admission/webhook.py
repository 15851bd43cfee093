"""``POST /mutate`` in front of the admin app: the HTTP side of sidecar injection.

The Kubernetes API server posts an AdmissionReview for every pod the
``MutatingWebhookConfiguration`` selects (deploy/kubernetes/webhook); the answer comes
from :func:`controlplane.admission.injection.mutate`, a pure function that never raises. This
wrapper only reads the body (bounded), answers 200 with the review as JSON, and hands
every other request to the admin app unchanged. It needs no bearer token: the API server
calls it over TLS (``--admin-tls-cert``/``--admin-tls-key``), and a review can only ask
for a patch to the pod it carries.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from controlplane.admission.injection import InjectionConfig, mutate
from controlplane.settings import ControlPlaneSettings

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATH = "/mutate"
MAX_REVIEW_BYTES = 8 * 1024 * 1024  # a pod spec is far smaller; the API server's limit is 3 MiB


def injection_config(settings: ControlPlaneSettings) -> InjectionConfig:
    """What injected sidecars get, from the control plane's ``--inject-*`` settings."""
    return InjectionConfig(
        sidecar_image=settings.inject_sidecar_image,
        nats_url=settings.inject_nats_url or settings.nats_url,
        nats_secret=settings.inject_nats_secret,
        drain_s=settings.inject_drain_s,
    )


def with_webhook(app: ASGIApp, config: InjectionConfig) -> ASGIApp:
    """``app`` with ``POST /mutate`` answered by the injection webhook."""

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == PATH:
            await _mutate(scope, receive, send, config)
        else:
            await app(scope, receive, send)

    return serve


async def _mutate(scope: Scope, receive: Receive, send: Send, config: InjectionConfig) -> None:
    if scope["method"] != "POST":
        await _answer(send, 405, {"detail": "POST an AdmissionReview to /mutate"})
        return
    body = await _read_body(receive)
    await _answer(send, 200, mutate(body if body is not None else b"", config))


async def _read_body(receive: Receive) -> bytes | None:
    """The request body, or None past :data:`MAX_REVIEW_BYTES` (answered as malformed)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_REVIEW_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
