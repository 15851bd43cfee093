"""Workload policies: validation names the field; classification picks the right one."""

from __future__ import annotations

import json

import pytest

from kvcore.workload import (
    STRATEGIES,
    InvalidWorkload,
    KvAwareWorkload,
    KvCostWorkload,
    RequestInfo,
    RoutingConfig,
    SessionAffinityWorkload,
    UnknownWorkload,
    parse_config,
    parse_workload,
)


def test_each_strategy_parses_to_its_own_model_with_defaults() -> None:
    for strategy in STRATEGIES:
        workload = parse_workload({"strategy": strategy, "name": f"w-{strategy}"})
        assert workload.strategy == strategy
        assert workload.load_threshold == 0.9
    kv = parse_workload('{"strategy": "kv_aware", "locality_weight": 0.25}')
    assert isinstance(kv, KvAwareWorkload) and kv.locality_weight == 0.25
    assert kv.fallback == "least_load" and kv.speculative_ttl_s == 2.0


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"strategy": "kv_aware", "locality_weight": 1.5}, "locality_weight"),
        ({"strategy": "kv_aware", "locality_weight": -0.1}, "locality_weight"),
        ({"strategy": "kv_cost", "load_threshold": 0}, "load_threshold"),
        ({"strategy": "least_load", "load_threshold": 1.01}, "load_threshold"),
        ({"strategy": "round_robin", "max_inflight_per_replica": 0}, "max_inflight_per_replica"),
        ({"strategy": "prefix_hash", "prefix_tokens": 0}, "prefix_tokens"),
        ({"strategy": "kv_aware", "speculative_ttl_s": -1}, "speculative_ttl_s"),
        ({"strategy": "kv_aware", "fallback": "kv_cost"}, "fallback"),
        ({"strategy": "session_affinity", "session_key": "two words"}, "session_key"),
        ({"strategy": "kv_cost", "prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
        ({"strategy": "kv_aware", "locality_wieght": 0.5}, "locality_wieght"),
        ({"strategy": "round_robin", "prefix_tokens": 8}, "prefix_tokens"),
        ({"strategy": "kv_awre"}, "strategy"),
        ({}, "strategy"),
        ({"strategy": "kv_aware", "name": "has space"}, "name"),
        ({"strategy": "kv_aware", "tenant_isolation": "maybe"}, "tenant_isolation"),
        ({"strategy": "kv_cost", "warmup": {"min_requests": 1}}, "warmup.min_requests"),
        ({"strategy": "kv_cost", "warmup": {"new_prefix_share": 1.5}}, "warmup.new_prefix_share"),
        ({"strategy": "kv_cost", "warmup": {"tokens_per_s": 0}}, "warmup.tokens_per_s"),
        ({"strategy": "kv_cost", "warmup": {"enabeld": True}}, "warmup.enabeld"),
    ],
)
def test_every_invalid_value_is_refused_naming_its_field(
    data: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidWorkload) as caught:
        parse_workload(data)
    assert str(caught.value).startswith(f"{field}: "), str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(InvalidWorkload) as caught:
        parse_workload({"strategy": "kv_aware", "locality_weight": 2, "load_threshold": 0})
    assert {p.split(":")[0] for p in caught.value.problems} == {"locality_weight", "load_threshold"}
    assert "(got 2)" in str(caught.value)


def test_workloads_are_frozen_and_round_trip_through_json() -> None:
    workload = KvCostWorkload(name="batch", locality_weight=0.4)
    with pytest.raises(ValueError, match="frozen"):
        workload.locality_weight = 0.9  # type: ignore[misc]
    assert parse_workload(workload.model_dump_json()) == workload


def test_warmup_is_off_by_default_and_round_trips_per_workload() -> None:
    assert parse_workload({"strategy": "kv_cost"}).warmup.enabled is False
    workload = parse_workload(
        {"strategy": "prefix_hash", "warmup": {"enabled": True, "min_requests": 4}}
    )
    assert workload.warmup.enabled and workload.warmup.min_requests == 4
    assert parse_workload(workload.model_dump_json()) == workload


def test_session_key_header_names_are_case_insensitive() -> None:
    assert SessionAffinityWorkload(session_key="X-Session-ID").session_key == "x-session-id"
    assert SessionAffinityWorkload(session_key="body.user").session_key == "body.user"


def test_fields_are_documented() -> None:
    schema = json.dumps(KvAwareWorkload.model_json_schema())
    for field in ("locality_weight", "load_threshold", "speculative_ttl_s", "fallback"):
        assert f'"{field}"' in schema
    for name, info in KvCostWorkload.model_fields.items():
        assert info.description or name == "strategy", name


CONFIG = {
    "workloads": [
        {"name": "default", "strategy": "least_load"},
        {"name": "chat", "strategy": "kv_aware"},
        {"name": "batch", "strategy": "kv_cost"},
        {"name": "tenant-a", "strategy": "prefix_hash"},
    ],
    "rules": [
        {"workload": "tenant-a", "api_key": "key-a"},
        {"workload": "batch", "path": "/v1/completions", "model": "llama-*"},
        {"workload": "chat", "model": "llama-*"},
        {"workload": "batch", "headers": {"X-Priority": "low*"}},
    ],
}


@pytest.mark.parametrize(
    ("request_info", "expected"),
    [
        (RequestInfo("/v1/chat/completions", model="llama-3"), "chat"),
        (RequestInfo("/v1/completions", model="llama-3"), "batch"),
        (RequestInfo("/v1/completions", model="qwen"), "default"),
        (RequestInfo("/v1/chat/completions", model="llama-3", api_key="key-a"), "tenant-a"),
        (RequestInfo.from_raw("/v1/x", {"X-Priority": "lowest"}), "batch"),
        (RequestInfo.from_raw("/v1/x", {"X-Priority": "high"}), "default"),
        (RequestInfo.from_raw("/v1/x", {"X-KVRoute-Workload": "batch"}, model="llama-3"), "batch"),
        (RequestInfo("/v1/chat/completions"), "default"),
    ],
)
def test_classification_order(request_info: RequestInfo, expected: str) -> None:
    assert parse_config(CONFIG).classify(request_info).name == expected


def test_a_header_naming_an_unknown_workload_is_refused() -> None:
    config = parse_config(CONFIG)
    with pytest.raises(UnknownWorkload, match="nope"):
        config.classify(RequestInfo.from_raw("/v1/x", {"x-kvroute-workload": "nope"}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"default_workload": "missing"}, "default_workload 'missing' is not defined"),
        ({"rules": [{"workload": "ghost", "model": "*"}]}, "undefined workloads"),
        ({"rules": [{"workload": "chat"}]}, "at least one of"),
        ({"workloads": []}, "workloads"),
        (
            {"workloads": [{"name": "default", "strategy": "least_load"}] * 2},
            "unique",
        ),
        (
            {"workloads": [{"name": "default", "strategy": "kv_aware", "locality_weight": 3}]},
            "workloads.0.locality_weight",
        ),
    ],
)
def test_invalid_configs_are_refused_with_the_reason(
    change: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidWorkload, match=message):
        parse_config({**CONFIG, **change})


def test_config_round_trips_through_json() -> None:
    config = parse_config(CONFIG)
    assert parse_config(config.model_dump_json()) == config
    assert isinstance(config, RoutingConfig)
