"""Typed settings of ``kvroute-controlplane``: flags, ``KVROUTE_*`` environment, defaults.

Every field is a flag (``--admin-port``) and an environment variable
(``KVROUTE_ADMIN_PORT``); a flag wins over the environment. Secrets (NATS and etcd
passwords and tokens, the admin token, a database URL with a password) come only from
the environment or from a file named by a ``*_file`` setting, never from a flag, and are
held as ``SecretStr`` so that no log line or error message shows them. Values are
validated at start-up: a pool, shard or instance id that cannot be a subject token or
etcd key segment, a port out of range or a TLS key without its certificate stops the
process before it connects anywhere.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, FilePath, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvcore.subjects import DEFAULT_ETCD_PREFIX, EtcdKeys, InvalidName, check_name
from kvruntime.flags import comma_list

MiB = 1024 * 1024

# Secret -> the setting naming a file it can be read from instead.
SECRET_FILES = {
    "nats_token": "nats_token_file",
    "nats_password": "nats_password_file",
    "etcd_password": "etcd_password_file",
    "database_url": "database_url_file",
    "admin_token": "admin_token_file",
}
# Settings only the environment (or a file) may set; main refuses them as flags.
ENV_ONLY = frozenset({"nats_token", "nats_password", "etcd_password", "admin_token"})


def default_instance_id() -> str:
    """The host name, reduced to characters a subject token allows."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:63].strip("-")
    return name or "controlplane"


class ControlPlaneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="forbid")

    # --- NATS: where sidecars publish ---------------------------------------------
    nats_url: str = Field(
        default="nats://127.0.0.1:4222",
        description="NATS server URL (comma-separated for a cluster; tls:// for TLS).",
    )
    nats_user: str | None = Field(default=None, description="NATS user name.")
    nats_password: SecretStr | None = Field(
        default=None, description="NATS password (environment or file only)."
    )
    nats_password_file: FilePath | None = Field(default=None, description="File holding it.")
    nats_token: SecretStr | None = Field(
        default=None, description="NATS token (environment or file only)."
    )
    nats_token_file: FilePath | None = Field(default=None, description="File holding it.")
    nats_creds_file: FilePath | None = Field(
        default=None, description="NATS credentials file (JWT + nkey seed)."
    )
    nats_tls_ca: FilePath | None = Field(default=None, description="CA bundle for NATS TLS.")
    nats_tls_cert: FilePath | None = Field(default=None, description="Client cert for NATS mTLS.")
    nats_tls_key: FilePath | None = Field(default=None, description="Client key for NATS mTLS.")

    # --- etcd: live config, membership, leader election ------------------------------
    etcd_endpoints: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1:2379"],
        description="etcd endpoints host:port (comma-separated).",
    )
    etcd_prefix: str = Field(
        default=DEFAULT_ETCD_PREFIX, description="Prefix of every key kvroute writes."
    )
    etcd_user: str | None = Field(default=None, description="etcd user name.")
    etcd_password: SecretStr | None = Field(
        default=None, description="etcd password (environment or file only)."
    )
    etcd_password_file: FilePath | None = Field(default=None, description="File holding it.")
    etcd_tls_ca: FilePath | None = Field(default=None, description="CA bundle for etcd TLS.")
    etcd_tls_cert: FilePath | None = Field(default=None, description="Client cert for etcd mTLS.")
    etcd_tls_key: FilePath | None = Field(default=None, description="Client key for etcd mTLS.")
    lease_ttl_s: int = Field(
        default=5,
        ge=2,
        le=300,
        description="TTL of the leader and membership leases: the standby takes over within it.",
    )

    # --- SQL: what happened ----------------------------------------------------------
    database_url: SecretStr = Field(
        default=SecretStr("sqlite+aiosqlite:///kvroute-controlplane.db"),
        description="SQLAlchemy async URL (a URL with a password: environment or file only).",
    )
    database_url_file: FilePath | None = Field(default=None, description="File holding it.")

    # --- admin REST API ---------------------------------------------------------------
    admin_host: str = Field(default="127.0.0.1", description="Bind address of the admin API.")
    admin_port: int = Field(default=8080, ge=0, le=65535, description="Admin API port.")
    admin_token: SecretStr | None = Field(
        default=None, description="Bootstrap admin token (environment or file only)."
    )
    admin_token_file: FilePath | None = Field(default=None, description="File holding it.")
    alert_webhook_url: str | None = Field(
        default=None, description="POST each alert change here as JSON."
    )
    admin_tls_cert: FilePath | None = Field(
        default=None,
        description="Server certificate: the admin API serves HTTPS when given (Kubernetes "
        "calls the injection webhook over HTTPS only).",
    )
    admin_tls_key: FilePath | None = Field(default=None, description="Its private key.")

    # --- sidecar injection (POST /mutate): what injected sidecars get ------------------
    inject_sidecar_image: str = Field(
        default="kvroute/sidecar:0.1.0", description="Image of the injected sidecar."
    )
    inject_nats_url: str = Field(
        default="", description="NATS URL of injected sidecars ('' = --nats-url)."
    )
    inject_nats_secret: str = Field(
        default="",
        description="Secret (in the engine's namespace) whose keys become injected sidecars' "
        "environment, e.g. KVROUTE_NATS_TOKEN ('' = none).",
    )
    inject_drain_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="Injected sidecars' --drain-s: a terminating engine pod is announced "
        "draining and keeps serving this long (the engine gets a preStop sleep as long and "
        "the pod a grace period of this plus 30 s; 0 = stop at once).",
    )

    # --- records: stats rollups and hit-rate alerts -----------------------------------------
    alert_hit_ratio: float = Field(
        default=0.7,
        gt=0,
        le=1,
        description="A workload's hit-rate alert opens when its measured hit ratio over "
        "the alert window falls below this fraction of its trailing baseline.",
    )
    alert_window_minutes: int = Field(
        default=10, ge=1, le=1440, description="Minutes the measured hit ratio is taken over."
    )
    alert_baseline_hours: float = Field(
        default=24.0, gt=0, le=24 * 30, description="Hours of the trailing baseline."
    )
    alert_min_requests: int = Field(
        default=100,
        ge=1,
        description="Measured requests the window and the baseline each need to judge.",
    )
    alert_interval_s: float = Field(
        default=30.0, gt=0, le=3600, description="How often the leader evaluates alerts."
    )
    rollup_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="How often the leader rolls proxies' reports into per-minute stats.",
    )
    stats_retention_days: float = Field(
        default=30.0,
        gt=0,
        description="Per-minute stats and rolled-up reports older than this are deleted.",
    )

    # --- gRPC RoutingState: what proxies watch --------------------------------------------
    grpc_host: str = Field(default="127.0.0.1", description="Bind address of the gRPC server.")
    grpc_port: int = Field(default=50051, ge=0, le=65535, description="gRPC port.")
    grpc_tls_cert: FilePath | None = Field(
        default=None, description="Server certificate: gRPC serves TLS when given."
    )
    grpc_tls_key: FilePath | None = Field(default=None, description="Server private key.")
    delta_interval_ms: float = Field(
        default=25.0, gt=0, le=50, description="Longest wait before batching a delta."
    )
    delta_ring: int = Field(
        default=2400, ge=1, description="Deltas kept for watchers that reconnect."
    )
    watcher_queue: int = Field(
        default=512,
        ge=1,
        description="Updates queued per watcher; a watcher this far behind is dropped.",
    )
    snapshot_chunk_bytes: int = Field(
        default=3 * MiB,
        ge=1024,
        le=4 * MiB - 64 * 1024,
        description="Largest snapshot chunk (below gRPC's 4 MiB message limit).",
    )

    # --- this instance, its shard and the fleet -------------------------------------
    instance_id: str = Field(
        default_factory=default_instance_id, description="This instance's id (host name)."
    )
    pools: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Pools this instance serves (comma-separated; empty: every pool).",
    )
    shard: str = Field(
        default="all", description="Shard name: the pair of instances serving --pools."
    )
    heartbeat_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="A replica silent this long is down and its residency dropped.",
    )
    panic_threshold: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="When more than this share of the live replicas fall silent together, "
        "they are kept as stale rather than downed: the bus is the likelier fault "
        "(Envoy's panic threshold; 1 turns it off).",
    )
    resync_timeout_s: float = Field(
        default=2.0, gt=0, le=60, description="Deadline of a resync request."
    )
    clear_chunk_keys: int = Field(
        default=20_000, ge=1, description="Keys dropped per step before yielding the loop."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Log level."
    )

    @field_validator("etcd_endpoints", "pools", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        return comma_list(value)

    @field_validator("etcd_endpoints")
    @classmethod
    def _host_ports(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one etcd endpoint is needed")
        for endpoint in value:
            host, _, port = endpoint.removeprefix("http://").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{endpoint!r} is not host:port")
        return [endpoint.removeprefix("http://") for endpoint in value]

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, value: list[str]) -> list[str]:
        return [_token("pool", pool) for pool in value]

    @field_validator("instance_id", "shard")
    @classmethod
    def _subject_token(cls, value: str) -> str:
        return _token("id", value)

    @field_validator("etcd_prefix")
    @classmethod
    def _etcd_prefix(cls, value: str) -> str:
        try:
            EtcdKeys(value)
        except InvalidName as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _secrets_from_files(self) -> ControlPlaneSettings:
        for secret, file_field in SECRET_FILES.items():
            path = getattr(self, file_field)
            if path is not None:
                setattr(self, secret, SecretStr(_read_secret(path, file_field)))
        return self

    @model_validator(mode="after")
    def _tls_pairs(self) -> ControlPlaneSettings:
        for prefix in ("nats_tls", "etcd_tls", "grpc_tls", "admin_tls"):
            cert, key = getattr(self, f"{prefix}_cert"), getattr(self, f"{prefix}_key")
            if (cert is None) != (key is None):
                flag = _flag(prefix)
                raise ValueError(f"--{flag}-cert and --{flag}-key go together")
        if (self.etcd_user is None) != (self.etcd_password is None):
            raise ValueError("--etcd-user and KVROUTE_ETCD_PASSWORD go together")
        return self

    def served_pools(self) -> tuple[str, ...] | None:
        """The pools to subscribe to, or ``None`` for every pool."""
        return tuple(self.pools) or None

    def secret(self, name: str) -> str | None:
        value = getattr(self, name)
        return None if value is None else value.get_secret_value()


def _token(what: str, value: str) -> str:
    try:
        return check_name(what, value)
    except InvalidName as exc:
        raise ValueError(str(exc)) from None


def _read_secret(path: Path, field: str) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"--{_flag(field)}: cannot read {path}: {exc.strerror}") from None
    if not text:
        raise ValueError(f"--{_flag(field)}: {path} is empty")
    return text


def _flag(field: str) -> str:
    return field.replace("_", "-")
