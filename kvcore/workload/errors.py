"""Errors of the workload model, and how validation errors are worded.

WorkloadError (ValueError)
 ├── InvalidWorkload     a policy or config that fails validation (400 at the API)
 └── UnknownWorkload     a request or rule names a workload that does not exist
"""

from __future__ import annotations

from pydantic import ValidationError


class WorkloadError(ValueError):
    """A workload or routing config problem."""


class InvalidWorkload(WorkloadError):
    """Validation failed; ``problems`` lists ``"field.path: message"`` strings."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class UnknownWorkload(WorkloadError):
    """No workload by that name."""


_TAG_ERRORS = {"union_tag_invalid", "union_tag_not_found"}


def describe(error: ValidationError, strategies: tuple[str, ...], root: str) -> InvalidWorkload:
    """One ``"field: message (got value)"`` per problem, without union tags in paths."""
    problems = []
    for item in error.errors(include_url=False):
        path = [str(part) for part in item["loc"] if part not in strategies]
        if item["type"] in _TAG_ERRORS:
            path.append("strategy")
        where = ".".join(path) or root
        got = f" (got {item['input']!r})" if "input" in item and _is_scalar(item) else ""
        problems.append(f"{where}: {item['msg']}{got}")
    return InvalidWorkload(problems)


def _is_scalar(item: object) -> bool:
    value = item["input"] if isinstance(item, dict) else None
    return isinstance(value, str | int | float | bool) or value is None
