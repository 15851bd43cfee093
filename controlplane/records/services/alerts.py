"""Hit-rate alerts: the operators' early warning that caching stopped working.

The commonest silent failure of a cache-aware router is a prompt change that breaks
prefix reuse (a timestamp put in front of the system prompt). The leader compares each
workload's engine-measured hit ratio over the last ``alert_window_minutes`` with its own
trailing baseline (the ``alert_baseline_hours`` before the window): an alert opens when
the ratio falls below ``alert_hit_ratio`` x baseline while both periods have at least
``alert_min_requests`` measured requests, and closes when the window's ratio is back at
or above that fraction of the baseline it opened against. Each change is committed with
an audit entry, logged, counted in metrics and, when ``--alert-webhook-url`` is set,
POSTed there as JSON (a failed POST is logged and counted, never retried forever).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from controlplane.records.db.models import Alert
from controlplane.records.db.repositories import (
    AlertRepository,
    AuditRepository,
    StatsRepository,
    Totals,
)
from controlplane.records.metrics import RecordsMetrics
from controlplane.settings import ControlPlaneSettings

log = logging.getLogger(__name__)

HIT_RATE = "hit_rate"
ACTOR = "alerts"
WEBHOOK_TIMEOUT_S = 5.0


def alert_json(alert: Alert) -> dict[str, Any]:
    return {
        "id": alert.id,
        "workload": alert.workload,
        "kind": alert.kind,
        "state": alert.state,
        "opened_at": alert.opened_at,
        "closed_at": alert.closed_at,
        "measured_hit_rate": round(alert.measured, 4),
        "baseline_hit_rate": round(alert.baseline, 4),
        "last_measured_hit_rate": round(alert.last_measured, 4),
        "detail": alert.detail,
    }


class AlertMonitor:
    def __init__(
        self,
        settings: ControlPlaneSettings,
        sessions: async_sessionmaker[AsyncSession],
        metrics: RecordsMetrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self._sessions = sessions
        self._metrics = metrics
        self._clock = clock
        self._http: aiohttp.ClientSession | None = None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def evaluate(self) -> list[dict[str, Any]]:
        """Open and close alerts from the stats; the changes, as the webhook gets them."""
        now = self._clock()
        since = int((now - self.settings.alert_window_minutes * 60) // 60 * 60)
        baseline_since = since - int(self.settings.alert_baseline_hours * 3600)
        async with self._sessions() as session:
            stats = StatsRepository(session)
            recent = await stats.totals_by_workload(since, int(now) + 60)
            baseline = await stats.totals_by_workload(baseline_since, since)
            alerts = AlertRepository(session)
            open_alerts = await alerts.open_by_workload(HIT_RATE)
            changed = []
            for workload in sorted(set(recent) | set(open_alerts)):
                alert = self._judge(
                    workload, recent.get(workload), baseline.get(workload), open_alerts, now
                )
                if alert is not None:
                    changed.append(alert)
                    alerts.add(alert)
                    self._audit(session, alert)
            await session.commit()
            events = [alert_json(alert) for alert in changed]
        for event in events:
            self._announce(event)
            await self._post(event)
        return events

    def _judge(
        self,
        workload: str,
        recent: Totals | None,
        baseline: Totals | None,
        open_alerts: dict[str, Alert],
        now: float,
    ) -> Alert | None:
        enough = self.settings.alert_min_requests
        if recent is None or recent.measured_requests < enough:
            return None
        measured = recent.measured_hit_rate
        if measured is None:
            return None
        alert = open_alerts.get(workload)
        if alert is not None:
            alert.last_measured = measured
            if measured >= self.settings.alert_hit_ratio * alert.baseline:
                alert.state, alert.closed_at = "closed", now
                return alert
            return None
        if baseline is None or baseline.measured_requests < enough:
            return None
        reference = baseline.measured_hit_rate
        if reference is None or measured >= self.settings.alert_hit_ratio * reference:
            return None
        return Alert(
            workload=workload,
            kind=HIT_RATE,
            state="open",
            opened_at=now,
            closed_at=None,
            measured=measured,
            baseline=reference,
            last_measured=measured,
            detail=(
                f"measured hit rate {measured:.1%} over the last "
                f"{self.settings.alert_window_minutes} min is below "
                f"{self.settings.alert_hit_ratio:.0%} of the trailing baseline {reference:.1%}"
            ),
        )

    def _audit(self, session: AsyncSession, alert: Alert) -> None:
        AuditRepository(session).add(
            actor=ACTOR,
            action=f"alert_{alert.state}",
            target=f"workload/{alert.workload}",
            result="ok",
            detail=alert.detail,
        )

    def _announce(self, event: dict[str, Any]) -> None:
        is_open = event["state"] == "open"
        log.warning(
            "hit-rate alert %s for workload %s: %s",
            "opened" if is_open else "closed",
            event["workload"],
            event["detail"],
        )
        self._metrics.alert_changes.labels(event["kind"], event["state"]).inc()
        self._metrics.alerts_open.labels(event["workload"], event["kind"]).set(int(is_open))

    async def _post(self, event: dict[str, Any]) -> None:
        url = self.settings.alert_webhook_url
        if not url:
            return
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT_S)
            )
        body = {
            "source": "kvroute-controlplane",
            "event": f"alert_{event['state']}",
            "alert": event,
        }
        try:
            async with self._http.post(url, json=body) as response:
                if response.status >= 300:
                    raise aiohttp.ClientResponseError(
                        response.request_info, (), status=response.status
                    )
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._metrics.webhook_failures.inc()
            log.warning("alert webhook POST failed: %s", type(exc).__name__)
