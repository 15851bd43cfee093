"""docs/operations.md names only metrics the components export and explains every alert
deploy/ defines, so an operator reading it finds what a scrape and Alertmanager show."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from controlplane.records.metrics import RecordsMetrics
from tests.unit.deploy.exported import exported_series, series_names

ROOT = Path(__file__).resolve().parents[3]
PAGE = (ROOT / "docs" / "operations.md").read_text()
RULES = ROOT / "deploy" / "kubernetes" / "observability" / "prometheus-rules.yaml"


def records_series() -> set[str]:
    """The records half's metrics, which `kvroute-controlplane` registers beside the
    fleet half's (`Records` builds them on the control plane's registry)."""
    registry = CollectorRegistry()
    RecordsMetrics(registry)
    return series_names(registry)


def test_every_metric_the_page_names_is_exported() -> None:
    named = set(re.findall(r"`(kvroute_[a-z_]+)", PAGE))
    series = exported_series() | records_series()
    missing = {n for n in named if n not in series and n + "_count" not in series}
    assert len(named) > 40
    assert not missing, f"docs/operations.md names metrics no component exports: {missing}"


def test_every_alert_has_a_row_with_what_to_do() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}
    rows = {m for m in re.findall(r"^\| `(Kvroute\w+)` \(\w+\) \|", PAGE, re.MULTILINE)}
    assert alerts and rows == alerts
