"""The engine's HTTP side: load figures from /metrics, endpoint discovery, settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from enginesim.metrics import CacheConfig, LoadSnapshot, RequestTiming, make_metrics
from sidecar.engine_http import (
    EventEndpoints,
    configured_endpoints,
    sglang_capacity,
    sglang_endpoints,
    vllm_endpoints,
)
from sidecar.errors import EngineUnavailable
from sidecar.load_metrics import (
    EngineLoad,
    PrefillTotals,
    parse_engine_load,
    restarted_between,
)
from sidecar.main import load_settings, main

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="2048"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
"""

SGLANG = """sglang:num_running_reqs{model_name="m",tp_rank="0"} 7.0
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 1.0
sglang:token_usage{model_name="m",tp_rank="0"} 0.75
sglang:prompt_tokens_total{model_name="m",tp_rank="0"} 5000.0
sglang:cached_tokens_total{cache_source="device",model_name="m",tp_rank="0"} 2000.0
"""


def test_vllm_metrics_are_summed_over_engines_and_usage_averaged() -> None:
    assert parse_engine_load(VLLM) == EngineLoad(
        running=5,
        waiting=4,
        kv_usage=0.375,
        prefix_cache_queries=1200,
        prefix_cache_hits=300,
        queries_reported=True,
        capacity_blocks=2048,
        engine_block_size=16,
    )


def test_sglang_metric_names() -> None:
    assert parse_engine_load(SGLANG) == EngineLoad(
        running=7,
        waiting=1,
        kv_usage=0.75,
        prefix_cache_queries=5000,
        prefix_cache_hits=2000,
        queries_reported=True,
    )


def test_a_queries_counter_that_went_back_is_a_restarted_engine() -> None:
    """A counter goes back only when its process started again (its cache empty); one
    missing from an exposition says nothing (0 is not read as a reset)."""
    old = parse_engine_load(VLLM)
    new = parse_engine_load(VLLM.replace("} 1200.0", "} 0.0"))
    assert restarted_between(old, new) and not restarted_between(new, old)
    assert not restarted_between(old, old) and not restarted_between(None, new)
    missing = parse_engine_load(VLLM.replace("vllm:prefix_cache_queries_total", "other"))
    assert not restarted_between(old, missing) and not restarted_between(missing, new)


def test_old_vllm_usage_name_and_garbage_lines() -> None:
    text = "vllm:gpu_cache_usage_perc 0.9\nvllm:num_requests_running NaN\nnot a metric\n{}\n"
    load = parse_engine_load(text)
    assert load.kv_usage == 0.9 and load.running == 0


def test_vllm_discovery_lists_every_rank_with_wildcard_hosts_resolved() -> None:
    body = {
        "1": {"endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5568", "topic": "kv"},
        "0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567", "topic": "kv"},
    }
    assert vllm_endpoints(body, "http://10.0.0.7:8000") == [
        EventEndpoints("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5567", "kv"),
        EventEndpoints("tcp://10.0.0.7:5558", "tcp://10.0.0.7:5568", "kv"),
    ]


def test_sglang_discovery_offsets_ports_by_rank() -> None:
    events = {
        "endpoint_host": "0.0.0.0",
        "endpoint_port_base": 6000,
        "replay_endpoint_port_base": 6100,
        "topic": "",
        "dp_size": 2,
    }
    assert sglang_endpoints({"kv_events": events}, "http://127.0.0.1:30000") == [
        EventEndpoints("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6100", ""),
        EventEndpoints("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6101", ""),
    ]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_total_num_tokens": 65536, "page_size": 16}, (4096, 16)),
        ({"max_total_num_tokens": 1000, "page_size": 1}, (1000, 1)),
        ({"max_total_num_tokens": "many", "page_size": 1}, (0, 0)),
        ({"page_size": 0, "max_total_num_tokens": 5}, (0, 0)),
        ([], (0, 0)),
    ],
)
def test_sglang_capacity_from_server_info(body: object, expected: tuple[int, int]) -> None:
    assert sglang_capacity(body) == expected


def test_configured_endpoints_are_one_per_rank() -> None:
    assert configured_endpoints("tcp://a:1, tcp://a:2", "tcp://a:11", "kv") == [
        EventEndpoints("tcp://a:1", "tcp://a:11", "kv"),
        EventEndpoints("tcp://a:2", None, "kv"),
    ]


@pytest.mark.parametrize("body", [{}, {"0": {"publisher": "null"}}, [], {"kv_events": None}])
def test_discovery_without_a_publisher_is_engine_unavailable(body: object) -> None:
    with pytest.raises(EngineUnavailable):
        vllm_endpoints(body, "http://h:1")
    with pytest.raises(EngineUnavailable):
        sglang_endpoints(body, "http://h:1")


def test_served_names_are_a_comma_list_as_flag_and_as_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVROUTE_SERVED_NAMES", "alias-a, alias-b")
    assert load_settings(["--replica-id", "r", "--model", "m"]).served_names == [
        "alias-a",
        "alias-b",
    ]
    flagged = load_settings(["--replica-id", "r", "--model", "m", "--served-names", "x,y"])
    assert flagged.served_names == ["x", "y"]


def test_flags_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_REPLICA_ID", "from-env")
    monkeypatch.setenv("KVROUTE_POOL", "pool-env")
    monkeypatch.setenv("KVROUTE_MODEL", "m")
    settings = load_settings(["--replica-id", "from-flag", "--kv-events-bind"])
    assert (settings.replica_id, settings.pool, settings.kv_events_bind) == (
        "from-flag",
        "pool-env",
        True,
    )
    assert (settings.host, settings.port, settings.engine_kind) == ("127.0.0.1", 9100, "vllm")


@pytest.mark.parametrize(
    "argv",
    [
        ["--replica-id", "a.b", "--model", "m"],
        ["--replica-id", "r", "--model", "m", "--pool", "p>"],
        ["--replica-id", "r", "--model", "m", "--kv-events-endpoint", "localhost:5557"],
        ["--replica-id", "r", "--model", "m", "--router-block-size", "0"],
        ["--replica-id", "r", "--model", " "],
        ["--replica-id", "r", "--model", "m", "--kv-events-endpoint", "tcp://a:1,a:2"],
        [
            "--replica-id",
            "r",
            "--model",
            "m",
            "--kv-events-endpoint",
            "tcp://a:1",
            "--replay-endpoint",
            "tcp://a:2,tcp://a:3",
        ],
    ],
)
def test_unusable_settings_are_refused(argv: list[str]) -> None:
    with pytest.raises(ValidationError):
        load_settings(argv)


@pytest.mark.parametrize(
    "extra", [["--nats-token", "s3cret"], ["--engine-kind", "tgi"], ["--log-level", "loud"]]
)
def test_secrets_are_not_flags_and_choices_are_checked(extra: list[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(["--replica-id", "r", "--model", "m", *extra])


def test_a_bad_engine_kind_from_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVROUTE_ENGINE_KIND", "tgi")
    with pytest.raises(ValidationError):
        load_settings(["--replica-id", "r", "--model", "m"])


def test_an_engine_ca_that_is_no_pem_bundle_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate")
    assert main(["--replica-id", "r", "--model", "m", "--engine-tls-ca", str(junk)]) == 2
    err = capsys.readouterr().err
    assert "engine_tls_ca" in err and "not a PEM CA bundle" in err


@pytest.mark.parametrize(
    ("engine_url", "host", "announced"),
    [
        ("http://127.0.0.1:8000", "", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000", "10.1.2.3", "http://10.1.2.3:8000"),
        ("http://127.0.0.1:8000/", "fd00::5", "http://[fd00::5]:8000/"),
        ("https://localhost", "engine-0.engines.svc", "https://engine-0.engines.svc"),
    ],
)
def test_the_engine_is_announced_at_the_advertised_host(
    engine_url: str, host: str, announced: str
) -> None:
    """The sidecar calls its engine where it can (loopback, in a pod); proxies elsewhere
    must be told the pod's address, with the engine's scheme, port and path."""
    argv = ["--replica-id", "r", "--model", "m", "--engine-url", engine_url]
    settings = load_settings([*argv, "--advertise-host", host] if host else argv)
    assert settings.advertised_url() == announced


def test_an_advertised_host_that_is_no_host_is_refused() -> None:
    with pytest.raises(ValidationError, match="advertise_host"):
        load_settings(["--replica-id", "r", "--model", "m", "--advertise-host", "a/b"])


@pytest.mark.parametrize("event_format", ["vllm", "sglang"])
def test_the_engines_own_prefill_timing_is_read_from_enginesims_exposition(
    event_format: str,
) -> None:
    """Two requests, each 0.5 s in prefill (one step), queued 1.0 and 0.8 s, 1,488 and
    1,000 tokens computed: the cumulative totals a LoadReport carries."""
    metrics = make_metrics(event_format, CacheConfig("m", 16, 1024, "sha256", 8192))
    timings = [RequestTiming(1.0, 0.5, 1488), RequestTiming(0.8, 0.5, 1000)]
    for (prompt, cached), timing in zip([(2000, 512), (1000, 0)], timings, strict=True):
        metrics.on_admitted(prompt, cached, 0, cached)
        metrics.on_first_token(timing.queue_s + timing.prefill_s, timing)
        metrics.on_finished(3.0, 2, timing)
    load = parse_engine_load(metrics.render(LoadSnapshot(0, 0, 0.0, 0)).decode())
    assert load.prefill is not None
    assert load.prefill.requests == 2 and load.prefill.computed_tokens == 2488
    assert load.prefill.seconds == pytest.approx(1.0)
    assert load.prefill.queue_seconds == pytest.approx(1.8)


def test_an_exposition_without_prefill_timing_reports_none() -> None:
    assert parse_engine_load(VLLM).prefill is None
    assert parse_engine_load(SGLANG).prefill is None  # no queueing series: no prefill
    old_vllm = VLLM + 'vllm:request_prefill_time_seconds_count{engine="0"} 4.0\n'
    old_vllm += 'vllm:request_prefill_time_seconds_sum{engine="0"} 2.0\n'
    prefill = parse_engine_load(old_vllm).prefill
    assert prefill == PrefillTotals(requests=4, seconds=2.0, computed_tokens=900)
