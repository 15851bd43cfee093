"""The etcd client from the settings: endpoints, user and password, TLS.

``aetcd`` opens one plaintext channel to one ``host:port``. :class:`EtcdClient` keeps
its whole API and changes only how the channel is opened: several endpoints become one
gRPC target that fails over between them (``ipv4:a:p,b:p``, when they are IP addresses;
otherwise the first endpoint), and TLS settings give a secure channel. The password goes
from the settings' ``SecretStr`` to the authentication call only.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher

from controlplane.settings import ControlPlaneSettings

log = logging.getLogger(__name__)


def grpc_target(endpoints: list[str]) -> str:
    """One gRPC target for the endpoints (failing over in order when they are IPs)."""
    if len(endpoints) == 1:
        return endpoints[0]
    try:
        for endpoint in endpoints:
            ipaddress.ip_address(endpoint.rpartition(":")[0].strip("[]"))
    except ValueError:
        log.warning("etcd endpoints are not all IP addresses: using the first only")
        return endpoints[0]
    return "ipv4:" + ",".join(endpoints)


class EtcdClient(aetcd.Client):  # type: ignore[misc]
    """``aetcd.Client`` over the settings' endpoints, credentials and TLS."""

    def __init__(self, settings: ControlPlaneSettings, *, timeout_s: float | None = None) -> None:
        host, _, port = settings.etcd_endpoints[0].rpartition(":")
        super().__init__(
            host,
            int(port),
            username=settings.etcd_user,
            password=settings.secret("etcd_password"),
            timeout=timeout_s,
        )
        self._target = grpc_target(settings.etcd_endpoints)
        self._credentials = _credentials(settings)

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]
            await super().connect()  # waits for the other task's connection
            return
        self._is_connecting = True
        try:
            self.channel = self._open_channel()
            await self._authenticate()
            self._stubs()
            self._connected.set()
        finally:
            self._is_connecting = False

    def _open_channel(self) -> Any:
        options = list(self._options.items())
        if self._credentials is None:
            return rpc.insecure_channel(self._target, options=options)
        return rpc.secure_channel(self._target, self._credentials, options=options)

    async def _authenticate(self) -> None:
        if self._username is None or self._password is None:
            return
        self.auth_stub = rpc.AuthStub(self.channel)
        request = rpc.AuthenticateRequest(name=self._username, password=self._password)
        try:
            response = await self.auth_stub.Authenticate(request, timeout=self._timeout)
        except rpc.AioRpcError as exc:  # never echo the request: it holds the password
            raise aetcd.ClientError(f"etcd authentication failed: {exc.code().name}") from None
        self.metadata = (("token", response.token),)

    def _stubs(self) -> None:
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )


def _credentials(settings: ControlPlaneSettings) -> grpc.ChannelCredentials | None:
    if settings.etcd_tls_ca is None and settings.etcd_tls_cert is None:
        return None
    ca = settings.etcd_tls_ca.read_bytes() if settings.etcd_tls_ca is not None else None
    cert = settings.etcd_tls_cert.read_bytes() if settings.etcd_tls_cert is not None else None
    key = settings.etcd_tls_key.read_bytes() if settings.etcd_tls_key is not None else None
    return grpc.ssl_channel_credentials(ca, key, cert)
