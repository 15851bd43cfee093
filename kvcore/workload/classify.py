"""Which workload a request belongs to, and the routing config that defines them.

Order: the ``x-kvroute-workload`` header names one outright (an unknown name is the
client's error); else the first rule whose every matcher matches (model glob, path
glob, API key id, header globs); else the config's default workload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Self

from pydantic import Field, field_validator, model_validator

from kvcore.workload.errors import UnknownWorkload
from kvcore.workload.model import NAME_PATTERN, Workload, _Settings

WORKLOAD_HEADER = "x-kvroute-workload"


class MatchRule(_Settings):
    """Send matching requests to ``workload``; every matcher given must match."""

    workload: str = Field(pattern=NAME_PATTERN, description="The workload to use.")
    model: str | None = Field(None, description="Glob on the request's model name.")
    path: str | None = Field(None, description="Glob on the request path.")
    api_key: str | None = Field(
        None, description="Id of the client API key (never the secret itself)."
    )
    headers: dict[str, str] = Field(
        default_factory=dict, description="Header name -> glob on its value."
    )

    @field_validator("headers")
    @classmethod
    def _lower_case_names(cls, value: dict[str, str]) -> dict[str, str]:
        return {name.lower(): glob for name, glob in value.items()}

    @model_validator(mode="after")
    def _has_a_matcher(self) -> Self:
        if self.model is None and self.path is None and self.api_key is None and not self.headers:
            raise ValueError("a rule needs at least one of model, path, api_key, headers")
        return self

    def matches(self, request: RequestInfo) -> bool:
        """Whether every matcher of this rule accepts ``request``."""
        return (
            _glob(self.model, request.model)
            and _glob(self.path, request.path)
            and (self.api_key is None or self.api_key == request.api_key)
            and all(_glob(g, request.headers.get(n)) for n, g in self.headers.items())
        )


class RoutingConfig(_Settings):
    """Every workload and the rules that pick one; what etcd stores and proxies get."""

    workloads: tuple[Workload, ...] = Field(min_length=1, description="Named workloads.")
    rules: tuple[MatchRule, ...] = Field((), description="Tried in order.")
    default_workload: str = Field("default", description="Used when no rule matches.")

    @model_validator(mode="after")
    def _names_resolve(self) -> Self:
        names = [w.name for w in self.workloads]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"workload names must be unique, repeated: {duplicates}")
        if self.default_workload not in names:
            raise ValueError(f"default_workload {self.default_workload!r} is not defined")
        unknown = [r.workload for r in self.rules if r.workload not in names]
        if unknown:
            raise ValueError(f"rules name undefined workloads: {unknown}")
        return self

    def workload(self, name: str) -> Workload:
        """The workload called ``name``; ``UnknownWorkload`` if there is none."""
        for workload in self.workloads:
            if workload.name == name:
                return workload
        raise UnknownWorkload(f"unknown workload {name!r}")

    def classify(self, request: RequestInfo) -> Workload:
        """The workload for ``request`` (header, else first matching rule, else default)."""
        named = request.headers.get(WORKLOAD_HEADER)
        if named is not None:
            return self.workload(named)
        for rule in self.rules:
            if rule.matches(request):
                return self.workload(rule.workload)
        return self.workload(self.default_workload)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What classification looks at; header names lower-case."""

    path: str
    model: str | None = None
    api_key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_raw(cls, path: str, headers: Mapping[str, str], **fields: Any) -> RequestInfo:
        """Lower-cases header names (HTTP servers hand them over as they came)."""
        return cls(path=path, headers={k.lower(): v for k, v in headers.items()}, **fields)


def _glob(pattern: str | None, value: str | None) -> bool:
    if pattern is None:
        return True
    return value is not None and fnmatchcase(value, pattern)
