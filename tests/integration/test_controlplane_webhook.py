"""The sidecar-injection webhook as the Kubernetes API server meets it: a control plane on
real NATS and etcd serving its admin API over TLS, an AdmissionReview POSTed to /mutate."""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from controlplane.service import ControlPlane
from controlplane.settings import ControlPlaneSettings
from kvroute.servers import EtcdServer, NatsServer
from tests.integration.controlplane_harness import server_certificate
from tests.unit.controlplane.admission import review, sglang_pod


@pytest.fixture
async def tls_control_plane(
    nats_server: NatsServer, etcd_server: EtcdServer, tmp_path: Path
) -> AsyncIterator[tuple[ControlPlane, ssl.SSLContext]]:
    authority, cert, key = server_certificate(
        tmp_path, "127.0.0.1", "kvroute-controlplane.kvroute.svc"
    )
    settings = ControlPlaneSettings(
        nats_url=nats_server.url,
        etcd_endpoints=[etcd_server.endpoint],
        etcd_prefix="/webhook-test/",
        admin_port=0,
        grpc_port=0,
        instance_id="cp-webhook",
        admin_tls_cert=cert,
        admin_tls_key=key,
        inject_sidecar_image="registry.example/kvroute/sidecar:9.9",
        inject_drain_s=20,
    )
    service = ControlPlane(settings)
    await service.start()
    client_context = ssl.create_default_context()
    authority.configure_trust(client_context)
    yield service, client_context
    await service.aclose()


async def test_mutate_over_tls_injects_the_configured_sidecar(
    tls_control_plane: tuple[ControlPlane, ssl.SSLContext], nats_server: NatsServer
) -> None:
    service, context = tls_control_plane
    base = f"https://127.0.0.1:{service.admin_port}"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/mutate", json=review(sglang_pod()), ssl=context) as answer:
            assert answer.status == 200
            body = await answer.json()
        async with http.post(f"{base}/mutate", data=b"{not json", ssl=context) as answer:
            malformed = await answer.json()
        async with http.get(f"{base}/mutate", ssl=context) as answer:
            assert answer.status == 405
        async with http.get(f"{base}/healthz", ssl=context) as answer:
            assert answer.status == 200  # the admin app behind the webhook still answers
    response = body["response"]
    assert response["uid"] == "uid-1" and response["allowed"] is True
    ops = json.loads(base64.b64decode(response["patch"]))
    sidecar = next(op["value"] for op in ops if op["path"] == "/spec/containers/-")
    assert sidecar["image"] == "registry.example/kvroute/sidecar:9.9"
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["KVROUTE_NATS_URL"] == nats_server.url  # --inject-nats-url unset: --nats-url
    assert env["KVROUTE_DRAIN_S"] == "20"  # --inject-drain-s: the pod drains 20 s on SIGTERM
    values = {op["path"]: op["value"] for op in ops}
    assert values["/spec/terminationGracePeriodSeconds"] == 50
    assert values["/spec/containers/0/lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "20"]
    assert malformed["response"]["allowed"] is True and "patch" not in malformed["response"]


async def test_plain_http_is_refused_when_tls_is_configured(
    tls_control_plane: tuple[ControlPlane, ssl.SSLContext],
) -> None:
    service, _ = tls_control_plane
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            async with http.get(f"http://127.0.0.1:{service.admin_port}/healthz") as answer:
                await answer.read()
