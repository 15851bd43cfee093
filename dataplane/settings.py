"""Typed settings of ``kvroute-proxy``: flags, ``KVROUTE_*`` environment, defaults.

Every field is a flag (``--static-replicas``) and an environment variable
(``KVROUTE_STATIC_REPLICAS``); a flag wins over the environment. List settings are
comma-separated. Values are validated at start-up, so a proxy with a bad address, an
impossible retry budget or no replica source at all never binds its port. Secrets (the
control plane's credentials, when it has some) come only from the environment.

The proxy routes from one of two sources:

- ``--controlplane ADDR[,ADDR...]``: gRPC ``RoutingState`` addresses (``host:port``); the
  proxy watches its ``--pools`` and reconnects to any of them;
- ``--static-replicas URL[,URL...]``: engine base URLs and no control plane at all
  (``--static-strategy`` ``prefix_hash``, ``least_load`` or ``round_robin``).
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, FilePath, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from dataplane.transport.cors import check_origin
from kvcore.keys import DEFAULT_BLOCK_SIZE
from kvcore.roles import split_role
from kvcore.subjects import InvalidName, check_name
from kvruntime.flags import comma_list

CommaList = Annotated[list[str], NoDecode]
LIST_FIELDS = frozenset({"controlplane", "pools", "static_replicas", "cors_allowed_origins"})


class ProxySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="forbid", frozen=True)

    # -- serving ---------------------------------------------------------------------
    host: str = Field(default="127.0.0.1", description="Bind address.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port (0: a free port).")
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve /metrics on this port (with /healthz) and not on --port, so a "
        "public Service of --port does not expose it (unset: /metrics on --port).",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Processes serving the one port (SO_REUSEPORT), each with its own "
        "state stream.",
    )
    proxy_index: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="This proxy's place (0, 1, 2...) among the proxies behind one "
        "balancer: kv_aware/kv_cost start their turn for new prompts spread round the "
        "fleet by it, so proxies taking turns in step do not send new prompts to the same "
        "replica at once (unset: the control plane numbers the proxies watching it, "
        "else a random start; kvroute up numbers its proxies; with --workers N, worker k "
        "is index * N + k).",
    )
    proxy_id: str = Field(
        default="",
        max_length=125,
        description="This proxy's id in Watch and Report ('' = host name and process id; "
        "with --workers N, worker k is ID/k).",
    )
    # -- where the routing state comes from -------------------------------------------
    controlplane: CommaList = Field(
        default_factory=list,
        description="Control-plane gRPC addresses host:port (comma-separated).",
    )
    pools: CommaList = Field(
        default_factory=list, description="Pools to route for (comma-separated; empty: all)."
    )
    static_replicas: CommaList = Field(
        default_factory=list,
        description="Engine base URLs to route to without a control plane (comma-separated); "
        "prefill=URL or decode=URL gives a replica its P/D role (SGLang's own is read from "
        "its /server_info).",
    )
    static_strategy: Literal["prefix_hash", "least_load", "round_robin"] = Field(
        default="prefix_hash", description="Strategy in static mode."
    )
    tokenizer: str = Field(
        default="builtin",
        description="Tokenizer of models the registry does not name: 'builtin' or a folder "
        "with tokenizer.json.",
    )
    block_size: int = Field(
        default=DEFAULT_BLOCK_SIZE,
        ge=1,
        le=4096,
        description="Router block size of models the registry does not name.",
    )
    controlplane_tls: bool = Field(
        default=False,
        description="Connect to the control plane over TLS, trusting the system's roots.",
    )
    controlplane_tls_ca: FilePath | None = Field(
        default=None,
        description="CA bundle (PEM) that signed the control plane's gRPC certificate; "
        "given: TLS trusting only it.",
    )
    replica_tls_ca: FilePath | None = Field(
        default=None,
        description="CA bundle (PEM) that signed the certificates of replicas named by "
        "https:// URLs (default: the system's roots).",
    )
    state_max_age_s: float = Field(
        default=30.0,
        gt=0,
        description="Routing state older than this makes kv_aware/kv_cost use the "
        "workload's fallback.",
    )
    prefill_step_ms: float = Field(
        default=5.0,
        gt=0,
        le=1000,
        description="While a kv_cost workload is configured, how often the proxy re-ages "
        "the prefill it has queued on each replica (its own books): an estimate is at most "
        "this much prefill high.",
    )
    residency_index: Literal["auto", "bitmask", "compact"] = Field(
        default="auto",
        description="How the proxy keeps the residency map: compact (numpy arrays, ~30 "
        "bytes a key; prompts read in C where it is built, as in the images and after make "
        "native: as fast on ordinary prompts, several times faster on long ones never seen "
        "before) or bitmask (a dict, ~110 bytes a key; without the C build, the faster on "
        "ordinary prompts). auto: compact where its C lookup is built, else bitmask.",
    )
    report_interval_s: float = Field(
        default=10.0, gt=0, le=3600, description="Period of the counters sent to the control plane."
    )
    # -- upstream and failures --------------------------------------------------------
    connect_timeout_s: float = Field(
        default=2.0, gt=0, le=300, description="Deadline to connect to a replica."
    )
    upstream_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Longest a replica may stay silent, before its answer's first bytes or "
        "between two of its pieces (then the request fails, on another replica if nothing "
        "reached the client yet).",
    )
    first_byte_floor_s: float = Field(
        default=1.0,
        gt=0,
        description="A streamed request waits at least this long for its first bytes "
        "before it moves to another replica and its replica is suspect (the deadline is "
        "the longer of this and first_byte_factor times the replica's typical time to "
        "first byte, plus the request's uncached tokens at first_byte_tokens_per_s; "
        "upstream_timeout_s caps it). A whole (non-streamed) answer may take longer: it "
        "moves once its replica has been silent that long (no answer's first bytes, no "
        "/health probe answered, one asked after half of it).",
    )
    first_byte_factor: float = Field(
        default=10.0,
        ge=1,
        description="How many times its replica's typical time to first byte a streamed "
        "request waits (room for the requests queued ahead of it); a whole one, how long "
        "its replica may stay silent.",
    )
    first_byte_tokens_per_s: float = Field(
        default=1000.0,
        gt=0,
        description="A prefill rate slower than any replica's: the deadline grows by the "
        "request's uncached tokens at this rate, so a long prompt is not cut for its length.",
    )
    probe_interval_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="Period of the /health probes of a suspect replica (one that missed a "
        "first-byte deadline); its first answer makes it routable again.",
    )
    probe_timeout_s: float = Field(
        default=1.0, gt=0, le=60, description="Deadline of one /health probe."
    )
    retry_attempts: int = Field(
        default=2,
        ge=0,
        le=10,
        description="Extra replicas tried after a connect failure or a 502/503 before the "
        "first byte.",
    )
    retry_budget: float = Field(
        default=0.2,
        ge=0,
        le=10,
        description="Retries allowed as a share of recent requests (over and above "
        "retry_min_per_s), so a failing fleet is not hit twice as hard.",
    )
    retry_min_per_s: float = Field(
        default=10.0, ge=0, description="Retries per second always allowed."
    )
    breaker_failures: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="Consecutive failures that take a replica out (circuit open).",
    )
    breaker_open_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How long a replica stays out before one probe request may try it.",
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        description="Largest request body accepted (413 above).",
    )
    retry_after_s: int = Field(
        default=1, ge=0, le=3600, description="Retry-After of a 503 when no replica can serve."
    )
    keep_alive_s: float = Field(
        default=75.0,
        gt=0,
        le=86400,
        description="An idle client connection is closed after this; keep it above the load "
        "balancer's own idle timeout (AWS ALB 60 s, Google Cloud's 600 s), or the balancer "
        "may send a request on a connection the proxy is closing.",
    )
    header_timeout_s: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        description="A request's line and headers must arrive within this of its first byte "
        "(of the connection, for its first request), else 408 and the connection closes: a "
        "client dripping header bytes holds a connection no longer, whatever keep-alive says.",
    )
    max_connections: int = Field(
        default=10000,
        ge=0,
        description="Client connections one proxy process (each of --workers) holds at once; "
        "one more is answered 503 (code too_many_connections, Retry-After 1) and closed "
        "(0: no cap). Keep it under the process's file-descriptor limit, less one upstream "
        "connection per request in flight.",
    )
    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        le=86400,
        description="On SIGTERM, how long requests in progress (streams too) may go on before "
        "their connections close; keep the pod's terminationGracePeriodSeconds above it.",
    )
    # -- clients ----------------------------------------------------------------------
    auth: bool = Field(
        default=False,
        description="Require a bearer key issued by the control plane (scope inference).",
    )
    tenant_header: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9-]{0,128}$",
        description="Without --auth, the request header naming the client's tenant (its "
        "cache namespace, which a body's cache_salt or prompt_cache_key only subdivides); "
        "only a front proxy that authenticates clients may set it. Ignored with --auth (the "
        "key's tenant wins). '' = none: tenants are not isolated.",
    )
    debug_headers: bool = Field(
        default=False,
        description="Answer with x-kvroute-replica, x-kvroute-workload, x-kvroute-prefix-blocks.",
    )
    cors_allowed_origins: CommaList = Field(
        default_factory=list,
        description="Origins whose browser pages may call the proxy (comma-separated "
        "scheme://host[:port], * for any; empty: none, no CORS headers).",
    )
    # -- observability ----------------------------------------------------------------
    tracing: bool = Field(
        default=False, description="OpenTelemetry spans with the routing decision."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Log level."
    )

    @field_validator(*LIST_FIELDS, mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        return comma_list(value)

    @field_validator("controlplane")
    @classmethod
    def _host_ports(cls, value: list[str]) -> list[str]:
        for address in value:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{address!r} is not host:port")
        return value

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, value: list[str]) -> list[str]:
        try:
            return [check_name("pool", pool) for pool in value]
        except InvalidName as exc:
            raise ValueError(str(exc)) from None

    @field_validator("replica_tls_ca")
    @classmethod
    def _ca_bundle(cls, value: Path | None) -> Path | None:
        if value is not None:
            try:
                ssl.create_default_context(cafile=str(value))
            except ssl.SSLError as exc:
                raise ValueError(f"not a PEM CA bundle: {exc.reason or exc}") from None
        return value

    @field_validator("static_replicas")
    @classmethod
    def _base_urls(cls, value: list[str]) -> list[str]:
        urls = []
        for entry in value:
            role, url = split_role(entry)
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http:// or https:// base URL")
            urls.append(f"{role}={url.rstrip('/')}" if role else url.rstrip("/"))
        return urls

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        return [check_origin(origin) for origin in value]

    @field_validator("tenant_header")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()

    @model_validator(mode="after")
    def _one_source(self) -> ProxySettings:
        if not self.controlplane and not self.static_replicas:
            raise ValueError("give --controlplane ADDR[,ADDR...] or --static-replicas URL[,...]")
        if self.controlplane and self.static_replicas:
            raise ValueError("--controlplane and --static-replicas exclude each other")
        if self.auth and self.static_replicas:
            raise ValueError("--auth needs keys from a control plane, not --static-replicas")
        if self.metrics_port is not None and self.metrics_port == self.port != 0:
            raise ValueError("--metrics-port must differ from --port")
        return self

    @property
    def static(self) -> bool:
        """Whether the proxy routes without a control plane."""
        return bool(self.static_replicas)

    def replica_ssl_context(self) -> ssl.SSLContext | None:
        """What checks the certificates of replicas named by ``https://`` URLs: one
        trusting ``replica_tls_ca``, or ``None`` for the system's roots (loading them
        takes some 30 ms, so the clients do it only once an https:// replica appears)."""
        ca = self.replica_tls_ca
        return None if ca is None else ssl.create_default_context(cafile=str(ca))

    def resolved_proxy_id(self) -> str:
        """``proxy_id``, or host name and process id (each worker its own)."""
        return self.proxy_id or f"{os.uname().nodename}-{os.getpid()}"

    def for_worker(self, index: int) -> ProxySettings:
        """The settings worker ``index`` of ``--workers`` runs with: a ``proxy_id`` of
        its own (``ID/index``), so that the reports stored by the control plane say which
        worker counted them (rows are unique by proxy id and report time: two workers'
        reports stamped alike under one id would be stored as one), and a place of its
        own among the routers (``proxy_index``): the workers are routers behind the
        kernel's balancer. Without ``--proxy-index`` the control plane numbers each
        worker's watch (the proxies of a Deployment are all alike: numbered here, every
        pod's worker k would start where the others' do); a static proxy's workers are
        the only routers, places 0..N-1."""
        update: dict[str, object] = {}
        if self.proxy_id:  # else host name and process id differ already
            update["proxy_id"] = f"{self.proxy_id}/{index}"
        if self.proxy_index is not None:
            update["proxy_index"] = self.proxy_index * self.workers + index
        elif self.static:
            update["proxy_index"] = index
        return self.model_copy(update=update)
