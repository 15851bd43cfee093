"""The control plane on a NATS that requires TLS and a token, as production runs it.

A real ``nats-server`` with a certificate from a test CA and ``--auth``: the control plane,
given the CA and the token, ingests a sidecar's announce and blocks over TLS; a client
without TLS or without the token is refused by the server.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.errors import NoServersError
from pydantic import SecretStr

from controlplane.service import ControlPlane
from controlplane.settings import ControlPlaneSettings
from kvroute.servers import EtcdServer, free_port, nats_command
from tests.integration.controlplane_harness import SidecarDouble, server_certificate
from tests.integration.sidecar_harness import wait_until

TOKEN = "nats-test-token-7d1c"


@pytest.fixture
async def tls_nats(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    ca, cert, key = server_certificate(tmp_path, "127.0.0.1", "localhost")
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    port = free_port()
    argv = [*nats_command(port), "--tls", "--tlscert", str(cert), "--tlskey", str(key)]
    argv += ["--auth", TOKEN]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        while b"Server is ready" not in (line := await proc.stdout.readline()):
            assert line, "nats-server exited before it was ready"
    try:
        yield f"tls://127.0.0.1:{port}", ca_path
    finally:
        proc.terminate()
        await proc.wait()


async def test_control_plane_ingests_over_nats_tls_with_a_token(
    tls_nats: tuple[str, Path], etcd_server: EtcdServer
) -> None:
    url, ca_path = tls_nats
    settings = ControlPlaneSettings(
        nats_url=url,
        nats_tls_ca=ca_path,
        nats_token=SecretStr(TOKEN),
        etcd_endpoints=[etcd_server.endpoint],
        etcd_prefix="/nats-tls/",
        admin_port=0,
        grpc_port=0,
        instance_id="cp-tls",
        pools=["tls"],
    )
    control_plane = ControlPlane(settings)
    await control_plane.start()
    context = ssl.create_default_context(cafile=str(ca_path))
    sidecar = SidecarDouble(
        url, "tls-r1", pool="tls", connect_options={"tls": context, "token": TOKEN}
    )
    try:
        await sidecar.start()
        await sidecar.announce()
        await sidecar.store(range(1, 33))
        await wait_until(
            lambda: [r.replica_id for r in control_plane.view.replicas()] == ["tls-r1"]
        )
        await wait_until(lambda: [r.resident_blocks for r in control_plane.view.replicas()] == [32])
    finally:
        await sidecar.stop()
        await control_plane.aclose()


@pytest.mark.parametrize("with_tls", [False, True], ids=["plaintext", "no-token"])
async def test_clients_without_tls_or_token_are_refused(
    tls_nats: tuple[str, Path], with_tls: bool
) -> None:
    url, ca_path = tls_nats
    options: dict[str, object] = {"connect_timeout": 2, "max_reconnect_attempts": 0}
    if with_tls:
        options["tls"] = ssl.create_default_context(cafile=str(ca_path))
    else:
        url = url.replace("tls://", "nats://")
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        nc = await nats.connect(url, allow_reconnect=False, **options)
        await nc.close()
