"""The metric names a PromQL expression reads: enough of PromQL to check that deploy/'s
rules and dashboard name only metrics that exist (strings, label matchers, ranges and
label lists removed; functions and keywords skipped)."""

from __future__ import annotations

import re

KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
    | {"offset", "bool", "inf", "nan", "Inf", "NaN"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _LABEL_LIST.sub("", text)
    names = set()
    for match in _NAME.finditer(text):
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before == ".":
            continue  # the exponent or unit of a number
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function
        if match.group() not in KEYWORDS:
            names.add(match.group())
    return names
