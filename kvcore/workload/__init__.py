"""Workload policies and request classification (pydantic v2 models).

``parse_workload`` / ``parse_config`` accept JSON text or decoded JSON and raise
:class:`InvalidWorkload` whose message names every bad field.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kvcore.workload.classify import WORKLOAD_HEADER, MatchRule, RequestInfo, RoutingConfig
from kvcore.workload.errors import InvalidWorkload, UnknownWorkload, WorkloadError, describe
from kvcore.workload.model import (
    STRATEGIES,
    FallbackStrategy,
    KvAwareWorkload,
    KvCostWorkload,
    LeastLoadWorkload,
    PrefixHashWorkload,
    RoundRobinWorkload,
    SessionAffinityWorkload,
    Workload,
    WorkloadBase,
)
from kvcore.workload.model_spec import ModelSpec
from kvcore.workload.warmup import WarmupSettings

__all__ = [
    "STRATEGIES",
    "WORKLOAD_HEADER",
    "FallbackStrategy",
    "InvalidWorkload",
    "KvAwareWorkload",
    "KvCostWorkload",
    "LeastLoadWorkload",
    "MatchRule",
    "ModelSpec",
    "PrefixHashWorkload",
    "RequestInfo",
    "RoundRobinWorkload",
    "RoutingConfig",
    "SessionAffinityWorkload",
    "UnknownWorkload",
    "WarmupSettings",
    "Workload",
    "WorkloadBase",
    "WorkloadError",
    "parse_config",
    "parse_model",
    "parse_workload",
]


@cache
def _adapter(kind: type[Any] | Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def _parse(kind: Any, data: str | bytes | dict[str, Any], root: str) -> Any:
    adapter = _adapter(kind)
    try:
        if isinstance(data, str | bytes):
            return adapter.validate_json(data)
        return adapter.validate_python(data)
    except ValidationError as exc:
        raise describe(exc, STRATEGIES, root) from None


def parse_workload(data: str | bytes | dict[str, Any]) -> Workload:
    """A validated workload from JSON text or a decoded JSON object."""
    workload: Workload = _parse(Workload, data, "workload")
    return workload


def parse_config(data: str | bytes | dict[str, Any]) -> RoutingConfig:
    """A validated routing config from JSON text or a decoded JSON object."""
    config: RoutingConfig = _parse(RoutingConfig, data, "config")
    return config


def parse_model(data: str | bytes | dict[str, Any]) -> ModelSpec:
    """A validated model entry from JSON text or a decoded JSON object."""
    spec: ModelSpec = _parse(ModelSpec, data, "model")
    return spec
