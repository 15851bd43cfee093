"""A NetworkPolicy evaluator for the ingress rules deploy/ writes: may a pod reach a port
of another pod? Enough of the semantics for matchLabels selectors and named or numbered
ports (what deploy/ uses); anything else fails loudly rather than answering wrongly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Doc = dict[str, Any]


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # container port name -> number


OUTSIDE = Pod("", {})  # an address outside the cluster (a managed database, the internet)


def _matches(selector: Doc | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return True
    assert set(selector) <= {"matchLabels"}, f"unsupported selector {selector}"
    wanted = selector.get("matchLabels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def _peer_matches(peer: Doc, source: Pod, policy_namespace: str) -> bool:
    assert "ipBlock" not in peer, "ipBlock peers are not evaluated"
    if source is OUTSIDE:
        return False  # pod and namespace selectors only ever match pods
    namespace_labels = {"kubernetes.io/metadata.name": source.namespace}
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], namespace_labels):
            return False
    elif source.namespace != policy_namespace:
        return False
    return _matches(peer.get("podSelector"), source.labels)


def _port_matches(ports: list[Doc] | None, target: Pod, port: int) -> bool:
    if not ports:
        return True
    for entry in ports:
        wanted = entry.get("port")
        if wanted is None or wanted == port or target.ports.get(str(wanted)) == port:
            return True
    return False


def _rule_allows(rule: Doc, peer: Pod, target: Pod, port: int, namespace: str) -> bool:
    peers = rule.get("from", rule.get("to"))
    peer_ok = not peers or any(_peer_matches(p, peer, namespace) for p in peers)
    return peer_ok and _port_matches(rule.get("ports"), target, port)


def _selecting(policies: list[Doc], pod: Pod, direction: str) -> list[Doc]:
    return [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and direction in p["spec"].get("policyTypes", ["Ingress"])
        and _matches(p["spec"]["podSelector"], pod.labels)
    ]


def allowed(policies: list[Doc], source: Pod, target: Pod, port: int) -> bool:
    """Whether ``source`` may open a connection to ``target`` on ``port``: the source's
    egress policies and the target's ingress policies must both let it through."""
    if source is not OUTSIDE:
        egress = _selecting(policies, source, "Egress")
        if egress and not any(
            _rule_allows(rule, target, target, port, source.namespace)
            for policy in egress
            for rule in policy["spec"].get("egress", [])
        ):
            return False
    return target is OUTSIDE or ingress_allowed(policies, source, target, port)


def ingress_allowed(policies: list[Doc], source: Pod, target: Pod, port: int) -> bool:
    """Whether ``source`` may open a connection to ``target`` on ``port``."""
    selecting = _selecting(policies, target, "Ingress")
    if not selecting:
        return True
    return any(
        _rule_allows(rule, source, target, port, target.namespace)
        for policy in selecting
        for rule in policy["spec"].get("ingress", [])
    )
