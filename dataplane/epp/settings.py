"""Typed settings of ``kvroute-epp``: flags, ``KVROUTE_*`` environment, defaults.

The endpoint picker routes on the same state as the proxy (a control plane's
``RoutingState.Watch``), so it takes the proxy's state and routing settings under the
same names, and :meth:`EppSettings.proxy_settings` hands them to the proxy's state
client and reporter. Its own: the three ports of Gateway API Inference Extension's
reference picker (ext_proc gRPC 9002, gRPC health 9003, Prometheus 9090), TLS for the
ext_proc port, how many fallback endpoints to give the gateway, and which inference
objectives may be shed (429) when every replica is saturated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, FilePath, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from dataplane.settings import ProxySettings
from kvruntime.flags import comma_list

CommaList = Annotated[list[str], NoDecode]
LIST_FIELDS = ("controlplane", "pools", "sheddable_objectives")
# the proxy's settings the picker takes as the proxy defines them, and hands on to the
# proxy's state client, reporter and router (EppSettings.proxy_settings)
FROM_THE_PROXY = (
    "controlplane", "pools", "controlplane_tls", "controlplane_tls_ca", "tokenizer",
    "block_size", "state_max_age_s", "prefill_step_ms", "report_interval_s", "tenant_header",
    "log_level", "residency_index",
)  # fmt: skip


def _proxy(name: str) -> Any:
    """The proxy's definition of a setting the picker shares (flag, bounds, description)."""
    return ProxySettings.model_fields[name]


class EppSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="forbid", frozen=True)

    # -- serving ---------------------------------------------------------------------
    host: str = Field(default="0.0.0.0", description="Bind address of the three ports.")
    grpc_port: int = Field(
        default=9002, ge=0, le=65535, description="ext_proc gRPC port (0: a free port)."
    )
    health_port: int = Field(
        default=9003,
        ge=0,
        le=65535,
        description="gRPC health port: services liveness, readiness and "
        "envoy.service.ext_proc.v3.ExternalProcessor (0: a free port).",
    )
    metrics_port: int = Field(
        default=9090, ge=0, le=65535, description="Prometheus /metrics port (0: a free port)."
    )
    tls_cert: FilePath | None = Field(
        default=None, description="PEM certificate chain of the ext_proc port (given: TLS)."
    )
    tls_key: FilePath | None = Field(default=None, description="PEM private key of tls_cert.")
    epp_id: str = Field(
        default="",
        max_length=125,
        description="This picker's id in Watch and Report ('' = host name and process id).",
    )
    # -- where the routing state comes from: as the proxy's ----------------------------
    controlplane: CommaList = _proxy("controlplane")
    pools: CommaList = _proxy("pools")
    controlplane_tls: bool = _proxy("controlplane_tls")
    controlplane_tls_ca: FilePath | None = _proxy("controlplane_tls_ca")
    tokenizer: str = _proxy("tokenizer")
    block_size: int = _proxy("block_size")
    state_max_age_s: float = _proxy("state_max_age_s")
    prefill_step_ms: float = _proxy("prefill_step_ms")
    report_interval_s: float = _proxy("report_interval_s")
    residency_index: Literal["auto", "bitmask", "compact"] = _proxy("residency_index")
    # -- picking ----------------------------------------------------------------------
    fallback_endpoints: int = Field(
        default=2,
        ge=0,
        le=16,
        description="Endpoints listed after the chosen one in x-gateway-destination-endpoint, "
        "for the gateway's retries (those holding more of the prompt first, then the less "
        "loaded).",
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        description="Largest request body picked for (413 above).",
    )
    sheddable_objectives: CommaList = Field(
        default_factory=list,
        description="Inference objectives (x-gateway-inference-objective) of negative "
        "priority: refused with 429 while every replica is saturated (comma-separated).",
    )
    tenant_header: str = _proxy("tenant_header")
    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        le=86400,
        description="On SIGTERM, readiness turns NOT_SERVING and streams in progress may go "
        "on this long before the server stops.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _proxy("log_level")

    @field_validator(*LIST_FIELDS, mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        return comma_list(value)

    @model_validator(mode="after")
    def _complete(self) -> EppSettings:
        if not self.controlplane:
            raise ValueError("give --controlplane ADDR[,ADDR...]")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        self.proxy_settings()  # the shared settings, validated as the proxy's
        return self

    def proxy_settings(self) -> ProxySettings:
        """The proxy's settings with the picker's shared ones, for the state client, the
        reporter and the router (the proxy's other settings at their defaults)."""
        shared = {name: getattr(self, name) for name in FROM_THE_PROXY}
        return ProxySettings(proxy_id=self.epp_id, max_body_bytes=self.max_body_bytes, **shared)
