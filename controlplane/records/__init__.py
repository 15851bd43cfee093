"""The records half of the control plane: what operators decide and what happened.

:class:`Records` is built once by the control plane's service with its settings, its
etcd client, the fleet half's :class:`~controlplane.contracts.FleetView` and the
process's Prometheus registry. It owns:

- ``config``: the live routing config in etcd (:class:`EtcdConfigStore`, the
  :class:`~controlplane.contracts.ConfigSource` the gRPC stream serves proxies);
- ``reports``: the proxies' counters (:class:`ReportInbox`, the
  :class:`~controlplane.contracts.ReportSink`);
- ``app``: the admin REST API (ASGI), served by the service with uvicorn;
- the SQL records (migrated at :meth:`Records.start`) and, on the leader only, the
  per-minute rollup of reports and the hit-rate alerts.
"""

from __future__ import annotations

from controlplane.records.service import Records

__all__ = ["Records"]
