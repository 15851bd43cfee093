"""The routing config as the control plane streams it, turned into what routing reads.

The control plane sends workloads as the JSON etcd stores, the classification rules as
one JSON document, models and hashed API keys as messages (``routing.proto``). A proxy
needs them validated and indexed once per config change, never per request:
:func:`fleet_config` does that. Formats:

- ``Workload.policy_json``: kvcore's workload JSON; the message's ``name`` wins over a
  name inside it;
- ``RoutingConfig.rules_json``: ``{"rules": [MatchRule, ...], "default_workload": name}``
  or empty (no rules, workload ``default``);
- ``Model.model_json``: kvcore's model entry (``ModelSpec``); read here are ``model``,
  the id the engines serve and block keys are rooted at (empty: the entry's name), and
  ``served_names``, other names clients use for it.

A config without workloads routes with :data:`DEFAULT_ROUTING` (one ``default``
workload: ``kv_aware`` falling back to ``prefix_hash`` while there is no residency).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dataplane.errors import StateError
from kvcore.pb import routing_pb2
from kvcore.workload import RoutingConfig, WorkloadError, parse_config

DEFAULT_ROUTING = parse_config({"workloads": [{"strategy": "kv_cost", "fallback": "prefix_hash"}]})


class InvalidConfig(StateError):
    """The control plane sent a routing config this proxy cannot use."""


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """One validated routing config with its lookups."""

    routing: RoutingConfig = DEFAULT_ROUTING
    models: dict[str, routing_pb2.Model] = field(default_factory=dict)
    api_keys: dict[str, routing_pb2.ApiKey] = field(default_factory=dict)  # by key_sha256
    aliases: dict[str, str] = field(default_factory=dict)  # other name -> canonical id
    entries: dict[str, routing_pb2.Model] = field(default_factory=dict)  # any name -> entry
    revision: int = 0

    def aliases_of(self, model: str) -> frozenset[str]:
        """Other names clients may use for the canonical model id ``model``."""
        return frozenset(alias for alias, name in self.aliases.items() if name == model)


def fleet_config(
    message: routing_pb2.RoutingConfig, default: RoutingConfig = DEFAULT_ROUTING
) -> FleetConfig:
    """``message`` validated; :class:`InvalidConfig` names what is wrong."""
    models = {model.name: model for model in message.models}
    aliases, entries = _names(models)
    return FleetConfig(
        routing=_routing(message, default),
        models=models,
        api_keys={key.key_sha256: key for key in message.api_keys},
        aliases=aliases,
        entries=entries,
        revision=message.revision,
    )


def _routing(message: routing_pb2.RoutingConfig, default: RoutingConfig) -> RoutingConfig:
    if not message.workloads:
        return default
    workloads = [_workload_json(w) for w in message.workloads]
    document: dict[str, Any] = {"workloads": workloads}
    document.update(_json_object(message.rules_json, "rules_json"))
    try:
        return parse_config(document)
    except WorkloadError as exc:
        raise InvalidConfig(f"routing config revision {message.revision}: {exc}") from None


def _workload_json(workload: routing_pb2.Workload) -> dict[str, Any]:
    policy = _json_object(workload.policy_json, f"workload {workload.name!r} policy_json")
    if workload.name:
        policy["name"] = workload.name
    return policy


def _names(
    models: dict[str, routing_pb2.Model],
) -> tuple[dict[str, str], dict[str, routing_pb2.Model]]:
    """Every name a model answers to: other name -> canonical id, and any name -> entry."""
    aliases: dict[str, str] = {}
    entries: dict[str, routing_pb2.Model] = {}
    for name, model in models.items():
        entry = _json_object(model.model_json, f"model {name!r} model_json")
        canonical = entry.get("model") or name
        others = entry.get("served_names", [])
        if not isinstance(canonical, str) or not isinstance(others, list):
            raise InvalidConfig(f"model {name!r}: model must be a name, served_names a list")
        for other in (canonical, name, *others):
            if not isinstance(other, str):
                raise InvalidConfig(f"model {name!r}: served name {other!r} is not a string")
            entries.setdefault(other, model)
            if other != canonical:
                aliases.setdefault(other, canonical)
    return aliases, entries


def _json_object(text: str, what: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidConfig(f"{what} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidConfig(f"{what} must be a JSON object, got {type(value).__name__}")
    return value
