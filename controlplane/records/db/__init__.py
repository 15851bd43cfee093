"""The control plane's durable records in SQL: what happened, never what is live.

etcd holds the live routing config; these tables hold its history (``config_revisions``),
who did what (``audit_log``), API tokens (hashed), proxies' counters rolled up per minute
(``workload_stats``, fed through ``proxy_reports``) and alerts. The schema is made only
by the Alembic migrations in ``migrations/``, run at start-up (:mod:`.database`).
"""
