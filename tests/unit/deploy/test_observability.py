"""The Prometheus rules and the Grafana dashboard: the rules pass ``promtool test
rules`` (promtool comes from Debian's prometheus package, via scripts/bootstrap), every
alert the operators were promised exists, and every metric either names is one the code
exports (or a recording rule defined beside it, or a series Prometheus makes itself)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy.exported import PROMETHEUS_OWN, exported_series
from tests.unit.deploy.manifests import KUBERNETES, find, overlays, render
from tests.unit.deploy.promql import metric_names

OBSERVABILITY = KUBERNETES / "observability"
RULES = OBSERVABILITY / "prometheus-rules.yaml"
DASHBOARD = OBSERVABILITY / "grafana-dashboard.json"
PROMTOOL = Path(sys.executable).parent / "promtool"
PROMISED_ALERTS = {
    "KvrouteHitRateBelowBaseline",  # a workload's hit rate below its baseline
    "KvroutePredictedMeasuredDrift",  # predicted and measured drifting apart
    "KvrouteTokenizerMismatch",  # a model flagged tokenizer_mismatch
    "KvrouteRoutingStateStale",  # routing state stale on a proxy
    "KvrouteReplicaDown",
    "KvrouteReplicasStale",  # replicas kept routed while the control plane hears nothing
    "KvrouteSidecarEventsLost",  # sidecar event gaps
    "KvrouteControlPlaneNoLeader",
}


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL.exists(), "promtool is missing: run scripts/bootstrap"
    return subprocess.run(
        [str(PROMTOOL), *args], cwd=OBSERVABILITY, capture_output=True, text=True, timeout=120
    )


def test_promtool_accepts_the_rules_and_their_tests_pass() -> None:
    check = promtool("check", "rules", RULES.name)
    assert check.returncode == 0, check.stdout + check.stderr
    test = promtool("test", "rules", "prometheus-rules.test.yaml")
    assert test.returncode == 0, test.stdout + test.stderr
    assert "SUCCESS" in test.stdout


def test_every_promised_alert_exists_and_is_tested() -> None:
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts >= PROMISED_ALERTS
    tested = (OBSERVABILITY / "prometheus-rules.test.yaml").read_text()
    for alert in alerts:
        assert f"alertname: {alert}" in tested, f"{alert} has no promtool test"


def known_series() -> set[str]:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    return exported_series() | recorded | PROMETHEUS_OWN


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_rules_and_dashboard_name_only_metrics_the_code_exports(source: str) -> None:
    exprs = [r["expr"] for r in rules()] if source == "rules" else dashboard_exprs()
    known = known_series()
    unknown = {name: expr for expr in exprs for name in metric_names(expr) - known}
    assert unknown == {}


@pytest.mark.parametrize("directory", overlays(), ids=[p.name for p in overlays()])
def test_autoscalers_scale_on_cpu_and_a_metric_the_proxies_export(directory: Path) -> None:
    hpa = find(render(directory), "HorizontalPodAutoscaler", "kvroute-proxy")
    kinds = {metric["type"] for metric in hpa["spec"]["metrics"]}
    assert kinds == {"Resource", "Pods"}
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "Pods":
            assert metric["pods"]["metric"]["name"] in exported_series()
        else:
            assert metric["resource"]["name"] == "cpu"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "kvroute-proxy",
    }


def test_the_metric_check_is_not_vacuous() -> None:
    expr = "sum(rate(kvroute_proxy_requests_totl[5m])) / kvroute_sidecar_router_keys"
    assert metric_names(expr) - known_series() == {"kvroute_proxy_requests_totl"}


def test_the_dashboard_covers_what_operators_watch() -> None:
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["templating"]["list"][0]["type"] == "datasource"
    text = " ".join(dashboard_exprs())
    for metric in (
        "kvroute_proxy_requests_total",  # requests per proxy
        "kvroute_proxy_decision_seconds_bucket",  # routing latency
        "kvroute:workload_measured_hit_rate:rate15m",  # measured vs predicted per workload
        "kvroute:workload_predicted_hit_rate:rate15m",
        "kvroute_proxy_measured_cached_tokens_total",  # per replica
        "kvroute_controlplane_resident_keys",  # residency size
        "kvroute_sidecar_engine_lag_seconds",  # event lag
        "kvroute_controlplane_resyncs_total",  # resyncs
        "kvroute_controlplane_replicas",  # replica status
        "ALERTS",
    ):
        assert metric in text, metric
