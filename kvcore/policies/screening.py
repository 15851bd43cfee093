"""Which replicas may take a request, which are saturated, and how ties are broken.

Shared by every strategy so that "why excluded" reads the same everywhere. Hard
exclusions (unhealthy, draining, wrong model, already tried) are final; saturation
(load at or over ``load_threshold``, or ``max_inflight_per_replica`` requests) only
counts while some replica is not saturated.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcore.policies.base import (
    Decision,
    Reasons,
    ReplicaReason,
    ReplicaState,
    RouteContext,
    StateView,
)

TIE = 1e-9
ALL_SATURATED = "every replica is saturated: considering all"
NO_REPLICA = "no replica can serve this request"


@dataclass(slots=True)  # one per request; a frozen init costs 3x
class Screened:
    """The outcome of screening a fleet for one request."""

    usable: list[ReplicaState]  # candidates the strategy chooses among
    saturated: dict[int, str]  # ordinal -> why, for saturated replicas left out of usable
    excluded: list[ReplicaReason]  # hard exclusions and left-out saturated replicas
    note: str = ""

    def __init__(  # written out: one per request (see dataplane/native.py)
        self,
        usable: list[ReplicaState],
        saturated: dict[int, str],
        excluded: list[ReplicaReason],
        note: str = "",
    ) -> None:
        self.usable = usable
        self.saturated = saturated
        self.excluded = excluded
        self.note = note


def hard_exclusion(replica: ReplicaState, ctx: RouteContext) -> str | None:
    """Why ``replica`` can never take this request, or ``None``."""
    models = replica.models
    if (
        replica.healthy
        and not replica.draining
        and (not models or ctx.model in models)
        and replica.ordinal not in ctx.exclude
    ):
        return None  # the usual answer, in one test (asked per replica per request)
    if replica.ordinal in ctx.exclude:
        return "already tried for this request"
    return static_exclusion(replica, ctx)


def static_exclusion(replica: ReplicaState, ctx: RouteContext) -> str | None:
    """Why ``replica`` can take no request for this model now, or ``None``."""
    if not replica.healthy:
        return "unhealthy"
    if replica.draining:
        return "draining"
    if replica.models and ctx.model not in replica.models:
        return f"does not serve model {ctx.model!r}"
    return None


def saturation(replica: ReplicaState, ctx: RouteContext) -> str | None:
    """Why ``replica`` counts as saturated for this workload, or ``None``."""
    workload = ctx.workload
    if replica.requests >= workload.max_inflight_per_replica:
        limit = workload.max_inflight_per_replica
        return f"{replica.requests} requests >= max_inflight_per_replica {limit}"
    if replica.load >= workload.load_threshold:
        return f"load {replica.load:.3f} >= load_threshold {workload.load_threshold}"
    return None


Saturation = Callable[[ReplicaState, RouteContext], str | None]


def screen(ctx: RouteContext, state: StateView, saturated_why: Saturation = saturation) -> Screened:
    """Candidates for ``ctx``: unsaturated ones, or all eligible ones if all are saturated
    (``saturated_why``: why a replica counts as saturated, a strategy's own test or the shared
    :func:`saturation`)."""
    return screen_rows(ctx, state.replicas(), saturated_why)


def screen_rows(
    ctx: RouteContext, replicas: Iterable[ReplicaState], saturated_why: Saturation = saturation
) -> Screened:
    """:func:`screen` over ``replicas`` (in ordinal order)."""
    excluded: list[ReplicaReason] = []
    usable: list[ReplicaState] = []
    saturated: dict[int, str] = {}
    left_out: list[ReplicaState] = []  # eligible but saturated
    for replica in replicas:
        why = hard_exclusion(replica, ctx)
        if why is not None:
            excluded.append(reason(replica, excluded=why))
        elif (why := saturated_why(replica, ctx)) is None:
            usable.append(replica)
        else:
            saturated[replica.ordinal] = why
            left_out.append(replica)
    if left_out:
        if not usable:  # every eligible replica is saturated
            return Screened(left_out, {}, excluded, ALL_SATURATED)
        excluded += [reason(r, excluded=saturated[r.ordinal]) for r in left_out]
    return Screened(usable, saturated, excluded)


def reason(
    replica: ReplicaState, *, excluded: str | None = None, score: float | None = None
) -> ReplicaReason:
    """A reason row for ``replica``: its load, and why it was left out or its score."""
    return ReplicaReason(
        replica.ordinal, replica.replica_id, replica.load, excluded=excluded, score=score
    )


def best(
    candidates: Sequence[ReplicaState], scores: dict[int, float], rng: random.Random
) -> ReplicaState:
    """Highest score; ties (within 1e-9) to the lower load, then at random."""
    return best_of(candidates, [scores[r.ordinal] for r in candidates], rng)


def best_of(
    candidates: Sequence[ReplicaState], values: Sequence[float], rng: random.Random
) -> ReplicaState:
    """:func:`best` with the candidates' scores in their order."""
    tied = best_tied(candidates, values)
    if len(tied) == 1:  # the usual case: no tie to break
        return tied[0]
    lowest = min(r.load for r in tied)
    tied = [r for r in tied if r.load <= lowest + TIE]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def best_tied(candidates: Sequence[ReplicaState], values: Sequence[float]) -> list[ReplicaState]:
    """The candidates whose score (``values``, in their order) is the highest, within 1e-9."""
    top = max(values) - TIE
    return [r for r, value in zip(candidates, values, strict=True) if value >= top]


def decide(
    strategy: str,
    screened: Screened,
    chosen: ReplicaState | None,
    rows: Callable[[list[ReplicaState]], Iterable[ReplicaReason]] = lambda _: (),
    *,
    note: str = "",
    extra: dict[str, Any] | None = None,
) -> Decision:
    """A decision whose reasons (``rows(screened.usable)``, built only when read) list
    every replica once, in ordinal order."""

    def chosen_row() -> ReplicaReason | None:
        return None if chosen is None else next(iter(rows([chosen])), None)

    reasons = Reasons(lambda: [*screened.excluded, *rows(screened.usable)], chosen_row)
    note = note or screened.note
    if chosen is None:
        note = note or NO_REPLICA
    if extra is None:
        return Decision(chosen, strategy, reasons, note)
    return Decision(chosen, strategy, reasons, note, extra=extra)


def plain_rows(usable: list[ReplicaState]) -> list[ReplicaReason]:
    """Rows with just the load, for strategies that do not score."""
    return [reason(r) for r in usable]
