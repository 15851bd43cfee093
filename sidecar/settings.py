"""Typed settings of ``kvroute-sidecar``: flags, ``KVROUTE_*`` environment, defaults.

Every field is a flag (``--engine-url``) and an environment variable
(``KVROUTE_ENGINE_URL``); a flag wins over the environment. Secrets (NATS credentials)
come only from the environment. Values are validated at start-up: a replica id or pool
that cannot be a NATS subject token, a router block size below 1 or an endpoint that is
not a ZMQ address stops the sidecar before it connects anywhere.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, FilePath, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvcore.keys import DEFAULT_BLOCK_SIZE
from kvcore.subjects import InvalidName, check_name

_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
# Settings only the environment may set: they have no flag.
ENV_ONLY = frozenset({"nats_token", "nats_user", "nats_password"})


class SidecarSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="forbid")

    engine_url: str = Field(
        default="http://127.0.0.1:8000", description="Base URL of the engine's HTTP server."
    )
    advertise_host: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9.:_-]{0,253}$",
        description="Host or IP the proxies reach the engine at, in place of --engine-url's "
        "own (which the sidecar itself calls, often on loopback); '' = --engine-url as it "
        "is. An injected sidecar takes its pod's IP (downward API).",
    )
    engine_kind: Literal["vllm", "sglang"] = Field(default="vllm", description="Engine family.")
    role: Literal["auto", "both", "prefill", "decode"] = Field(
        default="auto",
        description="The replica's part in disaggregated prefill/decode; auto: the engine's "
        "where it tells it (SGLang's --disaggregation-mode in /server_info), else both.",
    )
    bootstrap_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="An SGLang prefill server's bootstrap port (0: the engine's, from "
        "/server_info).",
    )
    engine_tls_ca: FilePath | None = Field(
        default=None,
        description="CA bundle (PEM) that signed an https:// engine's certificate "
        "(default: the system's roots).",
    )
    kv_events_endpoint: str | None = Field(
        default=None,
        description="ZMQ address of the engine's KV events, comma-separated per data-parallel "
        "rank (discovered if unset).",
    )
    kv_events_bind: bool = Field(
        default=False,
        description="Bind the SUB socket (the engine connects) instead of connecting.",
    )
    replay_endpoint: str | None = Field(
        default=None,
        description="ZMQ address of the engine's replay ROUTER, comma-separated per rank "
        "(replay off if unset).",
    )
    topic: str = Field(default="", description="ZMQ topic prefix to subscribe to ('' = all).")
    nats_url: str = Field(default="nats://127.0.0.1:4222", description="NATS server URL.")
    nats_token: SecretStr | None = Field(default=None, description="NATS token (environment only).")
    nats_user: str | None = Field(default=None, description="NATS user (environment only).")
    nats_password: SecretStr | None = Field(
        default=None, description="NATS password (environment only)."
    )
    nats_ping_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=120,
        description="Seconds between pings on the NATS connection. A server that stops "
        "answering without closing it (a partition, a stopped process) is declared dead on "
        "the tick after two pings went unanswered, within three intervals; the sidecar then "
        "reconnects and republishes its state. The control plane pings every "
        "--heartbeat-timeout-s/5, 1 s by default; nats-py's own default is 2 minutes.",
    )
    replica_id: str = Field(..., description="This replica's id (a subject token).")
    pool: str = Field(default="default", description="The replica's pool (a subject token).")
    model: str = Field(..., description="Canonical model id: part of every router key.")
    served_names: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Other names served (comma-separated)."
    )
    router_block_size: int = Field(
        default=DEFAULT_BLOCK_SIZE, ge=1, le=4096, description="Tokens per router block."
    )
    host: str = Field(default="127.0.0.1", description="Bind address of /healthz and /metrics.")
    port: int = Field(default=9100, ge=0, le=65535, description="Port of /healthz and /metrics.")
    batch_delay_ms: float = Field(
        default=1.0, ge=0, le=1000, description="Longest wait to coalesce events into a batch."
    )
    max_batch_events: int = Field(default=512, ge=1, le=100_000, description="Events per batch.")
    max_buffer_keys: int = Field(
        default=1_000_000, ge=1, description="Router keys held while NATS is down (~8 MB)."
    )
    max_buffer_events: int = Field(
        default=100_000, ge=1, description="Events held while NATS is down before dropping."
    )
    replay_timeout_s: float = Field(default=1.0, gt=0, le=60, description="Replay answer deadline.")
    announce_interval_s: float = Field(default=10.0, gt=0, description="ReplicaAnnounce period.")
    drain_s: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="On SIGTERM (a pod's termination) the sidecar first announces the "
        "replica draining, so that proxies send it no new request, then keeps running this "
        "long while the engine finishes the requests it has (give the engine's container a "
        "preStop sleep at least as long), then stops.",
    )
    load_interval_s: float = Field(default=0.5, gt=0, description="Scrape and LoadReport period.")
    restart_probe_s: float = Field(
        default=5.0,
        ge=0,
        description="After this long without a live batch, ask the replay socket whether "
        "the engine restarted unseen (0: only after the engine was unreachable).",
    )
    scrape_timeout_s: float = Field(default=2.0, gt=0, description="Engine HTTP request deadline.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Log level."
    )

    @field_validator("engine_tls_ca")
    @classmethod
    def _ca_bundle(cls, value: Path | None) -> Path | None:
        if value is not None:
            try:
                ssl.create_default_context(cafile=str(value))
            except ssl.SSLError as exc:
                raise ValueError(f"not a PEM CA bundle: {exc.reason or exc}") from None
        return value

    @field_validator("replica_id", "pool")
    @classmethod
    def _subject_token(cls, value: str) -> str:
        try:
            return check_name("id", value)
        except InvalidName as exc:
            raise ValueError(str(exc)) from None

    @field_validator("kv_events_endpoint", "replay_endpoint")
    @classmethod
    def _zmq_addresses(cls, value: str | None) -> str | None:
        if value is None:
            return None
        for address in value.split(","):
            if not address.strip().startswith(_ZMQ_SCHEMES):
                raise ValueError(f"{address!r} is not a ZMQ address (tcp://, ipc:// or inproc://)")
        return value

    @model_validator(mode="after")
    def _one_replay_per_rank(self) -> SidecarSettings:
        if self.replay_endpoint and self.kv_events_endpoint:
            events = len(self.kv_events_endpoint.split(","))
            if len(self.replay_endpoint.split(",")) > events:
                raise ValueError("more replay endpoints than event endpoints")
        return self

    @field_validator("served_names", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("model")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model must not be empty")
        return value

    def engine_ssl_context(self) -> ssl.SSLContext | None:
        """What checks an ``https://`` engine's certificate: one trusting
        ``engine_tls_ca``, or ``None`` for the system's roots."""
        ca = self.engine_tls_ca
        return None if ca is None else ssl.create_default_context(cafile=str(ca))

    def advertised_url(self) -> str:
        """The engine's base URL as announced to the control plane and the proxies:
        ``engine_url`` with ``advertise_host`` in place of its host, when given."""
        if not self.advertise_host:
            return self.engine_url
        parts = urlsplit(self.engine_url)
        host = self.advertise_host
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        netloc = host if parts.port is None else f"{host}:{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))
