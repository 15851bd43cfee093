"""The records: config revisions, audit log, API tokens, proxy reports, stats, alerts.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _id() -> sa.Column[int]:
    return sa.Column("id", Id, primary_key=True, autoincrement=True)


def _counters() -> list[sa.Column[int]]:
    names = (
        "requests",
        "prompt_tokens",
        "predicted_cached_tokens",
        "measured_cached_tokens",
        "measured_requests",
        "errors",
    )
    return [sa.Column(name, sa.BigInteger(), nullable=False) for name in names]


def upgrade() -> None:
    op.create_table(
        "config_revisions",
        _id(),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("etcd_revision", sa.BigInteger(), nullable=False),
        sa.Column("before", sa.Text(), nullable=True),
        sa.Column("after", sa.Text(), nullable=True),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_config_revisions")),
    )
    op.create_index("ix_config_revisions_kind_name", "config_revisions", ["kind", "name", "id"])
    op.create_table(
        "audit_log",
        _id(),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(200), nullable=False),
        sa.Column("result", sa.String(32), nullable=False),
        sa.Column("before", sa.Text(), nullable=True),
        sa.Column("after", sa.Text(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("key_sha256", sa.String(64), nullable=False),
        sa.Column("scopes", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=True),
        sa.Column("default_workload", sa.String(64), nullable=True),
        sa.Column("created_by", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("key_sha256", name=op.f("uq_api_tokens_key_sha256")),
    )
    op.create_table(
        "proxy_reports",
        _id(),
        sa.Column("proxy_id", sa.String(128), nullable=False),
        sa.Column("report_ts", sa.Double(), nullable=False),
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("workload", sa.String(64), nullable=False),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("replica_id", sa.String(128), nullable=False),
        *_counters(),
        sa.Column("rolled_up", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_proxy_reports")),
    )
    op.create_index(
        "uq_proxy_reports_row",
        "proxy_reports",
        ["proxy_id", "report_ts", "workload", "pool", "replica_id"],
        unique=True,
    )
    op.create_index("ix_proxy_reports_pending", "proxy_reports", ["rolled_up", "id"])
    op.create_table(
        "workload_stats",
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("workload", sa.String(64), nullable=False),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("replica_id", sa.String(128), nullable=False),
        *_counters(),
        sa.PrimaryKeyConstraint(
            "minute", "workload", "pool", "replica_id", name=op.f("pk_workload_stats")
        ),
    )
    op.create_index("ix_workload_stats_workload_minute", "workload_stats", ["workload", "minute"])
    op.create_table(
        "alerts",
        _id(),
        sa.Column("workload", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("opened_at", sa.Double(), nullable=False),
        sa.Column("closed_at", sa.Double(), nullable=True),
        sa.Column("measured", sa.Double(), nullable=False),
        sa.Column("baseline", sa.Double(), nullable=False),
        sa.Column("last_measured", sa.Double(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
    )
    op.create_index("ix_alerts_workload_state", "alerts", ["workload", "kind", "state"])


def downgrade() -> None:
    for table in (
        "alerts",
        "workload_stats",
        "proxy_reports",
        "api_tokens",
        "audit_log",
        "config_revisions",
    ):
        op.drop_table(table)
