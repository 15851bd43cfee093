"""Why requests missed their group's shared prefix: each request against its group's history.

The engines' hit rate says how much was missed, not why. Every request of the
shared-prefix workload belongs to a group whose system prompt the engine can cache; a
request *misses* when the engine reports fewer cached tokens than the most any request
of its group got (the group's shareable prefix). Replaying a run's answers in the order
they were sent, each miss has exactly one of these causes:

- ``first``: no request of its group was sent before it (every router, even an oracle
  with one unlimited cache, misses these);
- ``in_flight``: it went to a replica that had been sent its group before, but none of
  those had produced a first token yet (the engine had not cached the prefix);
- ``evicted``: its replica had already answered a request of its group (the prefix was
  cached there), yet the engine had less of it: evicted since, in part or whole;
- ``elsewhere``: its group had been sent to other replicas, never to this one (the
  router departed from the group's replica);
- ``unknown``: not the first, but the router does not say which replica it chose (the
  peer routers send no ``x-kvroute-replica`` header).

For kvroute, whose debug headers carry the prediction (``x-kvroute-prefix-blocks``),
predicted and measured cached tokens are compared too: a prediction of the whole prefix
that the engine did not hold is counted as ``over_predicted``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvroute.demo import Answer

CAUSES = ("first", "in_flight", "evicted", "elsewhere", "unknown")


@dataclass
class Misses:
    """One run's misses by cause, and kvroute's predictions against the engines'."""

    requests: int = 0
    first: int = 0
    in_flight: int = 0
    evicted: int = 0
    elsewhere: int = 0
    unknown: int = 0
    lost_tokens: int = 0  # prefix tokens recomputed by misses other than the first ones
    over_predicted: int = 0  # kvroute predicted the prefix held; the engine had less

    @property
    def avoidable(self) -> int:
        """Misses an ideal router would not have had (all but the first of each group)."""
        return self.in_flight + self.evicted + self.elsewhere + self.unknown

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def classify(answers: Sequence[Answer], groups: Sequence[int]) -> tuple[Misses, list[str]]:
    """The run's misses by cause, and each answer's cause ("" for a hit), in the order
    of ``answers``; ``groups[answer.index]`` is the answer's group."""
    prefix: dict[int, int] = defaultdict(int)
    for answer in answers:
        group = groups[answer.index]
        prefix[group] = max(prefix[group], answer.cached_tokens)
    sent: dict[int, list[Answer]] = defaultdict(list)  # group -> earlier answers
    causes = {}
    misses = Misses(requests=len(answers))
    for answer in sorted(answers, key=lambda a: a.sent_at):
        group = groups[answer.index]
        earlier = sent[group]
        cause = ""
        if answer.cached_tokens < prefix[group]:
            cause = _cause(answer, earlier)
            setattr(misses, cause, getattr(misses, cause) + 1)
            if cause != "first":
                misses.lost_tokens += prefix[group] - answer.cached_tokens
        if _predicted_tokens(answer) >= prefix[group] > answer.cached_tokens:
            misses.over_predicted += 1
        causes[id(answer)] = cause
        earlier.append(answer)
    return misses, [causes[id(a)] for a in answers]


def limit_hit_rate(answers: Sequence[Answer], groups: Sequence[int]) -> float:
    """The hit rate if only each group's first request had missed (an oracle's, with
    one unlimited cache): every other request cached its group's whole prefix."""
    prefix: dict[int, int] = defaultdict(int)
    count: dict[int, int] = defaultdict(int)
    for answer in answers:
        group = groups[answer.index]
        prefix[group] = max(prefix[group], answer.cached_tokens)
        count[group] += 1
    prompts = sum(a.prompt_tokens for a in answers)
    cached = sum(prefix[g] * (count[g] - 1) for g in prefix)
    return cached / prompts if prompts else 0.0


def _cause(answer: Answer, earlier: list[Answer]) -> str:
    if not earlier:
        return "first"
    if answer.replica == "?":
        return "unknown"
    here = [a for a in earlier if a.replica == answer.replica]
    if not here:
        return "elsewhere"
    if all(a.sent_at + a.ttft_s > answer.sent_at for a in here):
        return "in_flight"
    return "evicted"


def _predicted_tokens(answer: Answer) -> int:
    """Tokens kvroute predicted cached (its header counts blocks of the prompt), or -1."""
    held, _, blocks = answer.prefix_blocks.partition("/")
    if not held.isdigit() or not blocks.isdigit() or not int(blocks):
        return -1
    return round(answer.prompt_tokens * int(held) / int(blocks))


def records(answers: Sequence[Answer], groups: Sequence[int]) -> list[dict[str, Any]]:
    """One JSON-ready line per answer, in the order sent, with its miss cause."""
    _, causes = classify(answers, groups)
    start = min((a.sent_at for a in answers), default=0.0)
    rows = [
        {
            "sent_s": round(a.sent_at - start, 4),
            "group": groups[a.index],
            "replica": a.replica,
            "predicted_blocks": a.prefix_blocks,
            "prompt_tokens": a.prompt_tokens,
            "cached_tokens": a.cached_tokens,
            "ttft_ms": round(a.ttft_s * 1e3, 1),
            "miss": cause,
            "decision": a.decision,
        }
        for a, cause in zip(answers, causes, strict=True)
    ]
    return sorted(rows, key=lambda row: row["sent_s"])
