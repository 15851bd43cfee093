"""The control plane on an etcd that serves clients over TLS only.

A real one-member ``etcd`` with a certificate from a test CA: the control plane, given
the CA, elects itself leader and writes its membership over TLS; a client that does not
trust the CA cannot read from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controlplane.service import ControlPlane, ServiceError
from controlplane.settings import ControlPlaneSettings
from kvroute.servers import NatsServer, etcd_command, free_port
from tests.integration.controlplane_harness import SidecarDouble, server_certificate
from tests.integration.sidecar_harness import wait_until


@pytest.fixture
async def tls_etcd(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    ca, cert, key = server_certificate(tmp_path, "127.0.0.1", "localhost")
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    port, peer = free_port(), free_port()
    argv = [
        arg.replace(f"http://127.0.0.1:{port}", f"https://127.0.0.1:{port}")
        for arg in etcd_command(port, peer, tmp_path / "etcd")
    ]
    argv += ["--cert-file", str(cert), "--key-file", str(key)]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        while b"ready to serve client requests" not in (line := await proc.stdout.readline()):
            assert line, "etcd exited before it was ready"
    drain = asyncio.create_task(_drain(proc.stdout))
    try:
        yield f"127.0.0.1:{port}", ca_path
    finally:
        proc.terminate()
        await proc.wait()
        drain.cancel()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


async def test_control_plane_leads_and_keeps_membership_over_etcd_tls(
    tls_etcd: tuple[str, Path], nats_server: NatsServer
) -> None:
    endpoint, ca_path = tls_etcd
    settings = ControlPlaneSettings(
        nats_url=nats_server.url,
        etcd_endpoints=[endpoint],
        etcd_tls_ca=ca_path,
        etcd_prefix="/etcd-tls/",
        admin_port=0,
        grpc_port=0,
        instance_id="cp-etcd-tls",
        pools=["etcdtls"],
    )
    control_plane = ControlPlane(settings)
    await control_plane.start()
    sidecar = SidecarDouble(nats_server.url, "etcdtls-r1", pool="etcdtls")
    try:
        await sidecar.start()
        await sidecar.announce()
        await wait_until(control_plane.view.is_leader, deadline_s=30)
        await wait_until(lambda: len(control_plane.view.replicas()) == 1)
        info = await control_plane.view.set_draining("etcdtls-r1", True)
        assert info.draining
    finally:
        await sidecar.stop()
        await control_plane.aclose()


async def test_a_plaintext_etcd_endpoint_setting_does_not_reach_a_tls_etcd(
    tls_etcd: tuple[str, Path], nats_server: NatsServer
) -> None:
    endpoint, _ = tls_etcd
    settings = ControlPlaneSettings(
        nats_url=nats_server.url,
        etcd_endpoints=[endpoint],
        etcd_prefix="/etcd-tls-plain/",
        admin_port=0,
        grpc_port=0,
        instance_id="cp-etcd-plain",
        pools=["etcdplain"],
    )
    control_plane = ControlPlane(settings)
    with pytest.raises(ServiceError, match="did not answer"):
        await control_plane.start()
    await control_plane.aclose()
