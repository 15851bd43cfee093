"""SQLAlchemy 2.0 table models of the records (the schema itself comes from migrations).

Times are wall-clock seconds since the Unix epoch (``Double``), the same on SQLite and
PostgreSQL; a minute bucket is the epoch second its minute starts at. ``MetaData`` has a
naming convention so that migrations get stable constraint names on every database.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Double, Index, Integer, MetaData, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
Id = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER only


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ConfigRevision(Base):
    """One accepted change of the live config, after its etcd compare-and-swap."""

    __tablename__ = "config_revisions"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))  # workload | model | rules
    name: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(16))  # create | update | delete | rollback
    etcd_revision: Mapped[int] = mapped_column(BigInteger)  # mod revision written
    before: Mapped[str | None] = mapped_column(Text)  # JSON, None: did not exist
    after: Mapped[str | None] = mapped_column(Text)  # JSON, None: deleted
    actor: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(Double)

    __table_args__ = (Index("ix_config_revisions_kind_name", "kind", "name", "id"),)


class AuditEntry(Base):
    """Every write through the admin API, accepted or refused, and every alert change."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Double)
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(200))
    result: Mapped[str] = mapped_column(String(32))  # ok | precondition_failed | ...
    before: Mapped[str | None] = mapped_column(Text)
    after: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[str] = mapped_column(Text, default="")


class ApiToken(Base):
    """A bearer token, kept only as the SHA-256 of its secret."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    key_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[str] = mapped_column(String(64))  # comma-separated
    tenant: Mapped[str | None] = mapped_column(String(64))
    default_workload: Mapped[str | None] = mapped_column(String(64))
    created_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Double)


class ProxyReportRow(Base):
    """One row of a proxy's report, kept until the leader rolls it into a minute.

    ``(proxy_id, report_ts, workload, pool, replica_id)`` is unique, so a report sent
    twice (a proxy retrying after a reconnect) counts once; ``rolled_up`` is set in the
    same transaction that adds the row to ``workload_stats``.
    """

    __tablename__ = "proxy_reports"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    proxy_id: Mapped[str] = mapped_column(String(128))
    report_ts: Mapped[float] = mapped_column(Double)
    minute: Mapped[int] = mapped_column(BigInteger)
    workload: Mapped[str] = mapped_column(String(64))
    pool: Mapped[str] = mapped_column(String(64))
    replica_id: Mapped[str] = mapped_column(String(128))
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    predicted_cached_tokens: Mapped[int] = mapped_column(BigInteger)
    measured_cached_tokens: Mapped[int] = mapped_column(BigInteger)
    measured_requests: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    rolled_up: Mapped[bool] = mapped_column(default=False)

    __table_args__ = (
        Index(
            "uq_proxy_reports_row",
            "proxy_id",
            "report_ts",
            "workload",
            "pool",
            "replica_id",
            unique=True,
        ),
        Index("ix_proxy_reports_pending", "rolled_up", "id"),
    )


class WorkloadStat(Base):
    """Counters of one workload on one replica over one minute."""

    __tablename__ = "workload_stats"

    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    workload: Mapped[str] = mapped_column(String(64), primary_key=True)
    pool: Mapped[str] = mapped_column(String(64), primary_key=True)
    replica_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    predicted_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    measured_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    measured_requests: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)

    __table_args__ = (Index("ix_workload_stats_workload_minute", "workload", "minute"),)


class Alert(Base):
    """A hit-rate alert of one workload: open until its measured hit rate recovers."""

    __tablename__ = "alerts"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    workload: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16))  # open | closed
    opened_at: Mapped[float] = mapped_column(Double)
    closed_at: Mapped[float | None] = mapped_column(Double)
    measured: Mapped[float] = mapped_column(Double)  # hit ratio that opened it
    baseline: Mapped[float] = mapped_column(Double)
    last_measured: Mapped[float] = mapped_column(Double)
    detail: Mapped[str] = mapped_column(Text, default="")

    __table_args__ = (Index("ix_alerts_workload_state", "workload", "kind", "state"),)
