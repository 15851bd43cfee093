"""The prefill speeds the proxies have learned, per replica, for ``/v1/replicas``.

Each proxy learns every replica's prefill rate from its own first-token timings
(:class:`kvcore.policies.prefill.PrefillRates`) and sends what it has learned in its
reports (``ProxyReport.learned_rates``). This keeps each proxy's latest figures and
shows, per replica, the median over the proxies that reported one within ``max_age_s``
(a proxy gone quiet, or that has stopped learning, ages out), and how many did. A control
plane instance sees the reports sent to it: behind several instances each shows the
proxies reporting to it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvcore.pb import routing_pb2

MAX_AGE_S = 60.0  # six of the proxies' default 10 s report intervals


@dataclass(slots=True)
class _Proxy:
    ts: float  # the report's own wall-clock stamp (a late report does not win)
    received: float  # monotonic, for ageing
    rates: dict[str, routing_pb2.LearnedRate]


class LearnedRates:
    """The proxies' latest learned rates (see the module docstring)."""

    def __init__(
        self, max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._proxies: dict[str, _Proxy] = {}

    def on_report(self, report: routing_pb2.ProxyReport) -> None:
        """A report with learned rates replaces its proxy's figures; one without (a
        proxy that has learned nothing, a copy of hot prefixes) leaves them to age."""
        if not report.learned_rates:
            return
        known = self._proxies.get(report.proxy_id)
        if known is not None and known.ts > report.ts:
            return
        rates = {rate.replica_id: rate for rate in report.learned_rates}
        self._proxies[report.proxy_id] = _Proxy(report.ts, self._clock(), rates)

    def state_of(self, replica_id: str) -> dict[str, Any] | None:
        """The replica's learned figures as ``/v1/replicas`` shows them; ``None`` while
        no proxy has reported one lately."""
        self._age()
        rows = [p.rates[replica_id] for p in self._proxies.values() if replica_id in p.rates]
        if not rows:
            return None
        return {
            "prefill_tokens_per_s": _median(r.prefill_tokens_per_s for r in rows),
            "line_tokens_per_s": _median(r.line_tokens_per_s for r in rows if r.line_tokens_per_s),
            "line_fixed_s": _median(r.line_fixed_s for r in rows if r.line_tokens_per_s),
            "slowness": _median(r.slowness for r in rows if r.slowness),
            "engine_tokens_per_s": _median(
                r.engine_tokens_per_s for r in rows if r.engine_tokens_per_s
            ),
            "proxies": len(rows),
        }

    def _age(self) -> None:
        oldest = self._clock() - self.max_age_s
        for proxy_id in [p for p, known in self._proxies.items() if known.received < oldest]:
            del self._proxies[proxy_id]


def _median(values: Iterable[float]) -> float | None:
    ordered = list(values)
    return round(statistics.median(ordered), 3) if ordered else None
