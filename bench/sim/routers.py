"""kvroute's own strategies in the simulator: the real ``kvcore.policies`` code.

A :class:`KvrouteRouter` is one proxy: it builds ``ReplicaState`` rows the way the proxy
does (engine-reported running, waiting and KV usage from the last load sample, less its
own requests that sample counted and that have ended since, plus its own requests still
in flight that were sent after that sample, from an ``InflightLedger``, as
``unreported``) and keeps them on a ``ReplicaBoard`` (one row
replaced per change, so a decision need not visit every replica), keeps its own copy of the
residency map in a ``kvcore.index.BitmaskResidencyIndex`` fed by the engines' events,
calls ``create_policy(workload).select(ctx, view)`` and records the decision's
speculative residency, exactly as the proxy will. For ``kv_cost`` it also keeps a
``PrefillLedger`` (its requests still waiting for a first token, as
``queued_prefill_tokens``), as the proxy does (``dataplane.fleet.prefill_books``).

Policy specs: ``STRATEGY`` or ``STRATEGY:field=value,field=value`` with any field of the
strategy's workload model (``kv_aware:locality_weight=0.5,min_hit=0.2``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from bench.sim.engine import EngineShape
from bench.sim.simulator import FleetReadout
from bench.sim.workloads import Request
from kvcore.index import BitmaskResidencyIndex
from kvcore.policies import (
    InflightLedger,
    PrefillLedger,
    ReplicaState,
    RouteContext,
    create_policy,
)
from kvcore.policies.board import ReplicaBoard
from kvcore.policies.inflight import discount_ended
from kvcore.workload import STRATEGIES, KvCostWorkload, Workload, parse_workload

MODEL = "sim-model"


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name:field=value,...`` -> (name, fields); values parsed as JSON scalars if they can be."""
    name, _, rest = spec.partition(":")
    fields: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"policy {spec!r}: expected field=value, got {item!r}")
        fields[key.strip()] = _scalar(raw.strip())
    return name.strip(), fields


def _scalar(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "null":  # a setting turned off, as a workload's JSON says it
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def is_kvroute(spec: str) -> bool:
    return spec.partition(":")[0].strip() in STRATEGIES


class _View:
    """The ``StateView`` a proxy would hand its policy."""

    def __init__(self, router: KvrouteRouter) -> None:
        self._router = router

    def replicas(self) -> Sequence[ReplicaState]:
        return self._router.board

    def leading_runs(self, keys: Sequence[int], *, now: float | None) -> dict[int, int]:
        return self._router.index.leading_runs(keys, now=now)

    def placed_blocks(self, ordinal: int, *, now: float) -> int:
        return self._router.index.speculative_count(ordinal, now=now)

    def has_residency(self) -> bool:
        return self._router.index.key_count() > 0

    def inflight(self) -> int:
        return self._router.inflight()


class KvrouteRouter:
    """One kvroute proxy instance running a real ``kvcore`` policy."""

    wants_residency = True

    def __init__(
        self,
        spec: str,
        fleet: FleetReadout,
        shape: EngineShape,
        seed: int,
        load_period_s: float,
        place: int | None = None,
    ) -> None:
        """``place``: this router's index behind the balancer (``None``: a lone router)."""
        name, fields = parse_spec(spec)
        self.name = spec
        self.workload: Workload = parse_workload({"strategy": name, **fields})
        self.policy = create_policy(self.workload, rng=random.Random(seed), place=place)
        self.fleet = fleet
        self.shape = shape
        self.load_period_s = load_period_s
        self.index = BitmaskResidencyIndex()
        self.view = _View(self)
        n = len(fleet.replicas)
        self._ledger = InflightLedger()
        self._prefill = self._prefill_ledger(self.workload)
        self._prefill_tickets: dict[int, int] = {}
        self._now = 0.0
        self._tickets: dict[int, int] = {}  # request id -> ledger ticket
        self._epoch = -1
        self._taken_at = -1e18
        self.board = ReplicaBoard(self._state(i) for i in range(n))
        self._next_expiry = 1.0

    def _state(self, ordinal: int) -> ReplicaState:
        sample, ledger, taken_at = self.fleet.samples[ordinal], self._ledger, self._taken_at
        running, waiting, kv_usage = discount_ended(
            sample.running, sample.waiting, sample.kv_usage, ledger.ended(ordinal, taken_at)
        )
        return ReplicaState(
            ordinal,
            f"replica-{ordinal}",
            running=running,
            waiting=waiting,
            kv_usage=kv_usage,
            unreported=ledger.unreported(ordinal, taken_at),
            capacity=self.shape.max_num_seqs,
            prefill_tokens_per_s=self._prefill_rate(ordinal),
            queued_prefill_tokens=self._queued_prefill(ordinal),
            extra_step_s=self._extra_step(ordinal),
        )

    @staticmethod
    def _prefill_ledger(workload: Workload) -> PrefillLedger | None:
        """Prefill books for the strategy that reads them (kv_cost); the others skip the
        extra residency lookup per request."""
        if isinstance(workload, KvCostWorkload):
            return PrefillLedger(
                workload.prefill_tokens_per_s, engine_rates=workload.engine_prefill_rates
            )
        return None

    def _prefill_rate(self, ordinal: int) -> float | None:
        ledger = self._prefill
        return None if ledger is None else ledger.rates.rate(ordinal)

    def _extra_step(self, ordinal: int) -> float:
        ledger = self._prefill
        return 0.0 if ledger is None else ledger.rates.step_s(ordinal)

    def _queued_prefill(self, ordinal: int) -> float | None:
        ledger = self._prefill
        return None if ledger is None else ledger.queued_tokens(ordinal, self._now)

    def _refresh(self) -> None:
        fleet = self.fleet
        if (
            fleet.epoch != self._epoch
            and fleet.sampled_at - self._taken_at >= self.load_period_s - 1e-9
        ):
            self._epoch, self._taken_at = fleet.epoch, fleet.sampled_at
            if self._prefill is not None:  # the engines' prefill timing, as reported
                rates = self._prefill.rates
                for i, sample in enumerate(fleet.samples):
                    rates.engine_report(
                        i,
                        sample.prefill_requests,
                        sample.prefill_seconds,
                        sample.prefill_computed_tokens,
                        fleet.sampled_at,
                    )
            self.board = ReplicaBoard(self._state(i) for i in range(len(self.board)))

    def route(self, req: Request, now: float, exclude: frozenset[int] = frozenset()) -> int:
        """``exclude``: replicas this decision may not take (``bench.sim.lora``)."""
        if self._prefill is not None and now != self._now:
            self._now = now  # queued prefill ages with time, not only with load samples
            self.board = ReplicaBoard(self._state(i) for i in range(len(self.board)))
        self._refresh()
        if now >= self._next_expiry:
            self.index.expire(now)
            self._next_expiry = now + 1.0
        ctx = RouteContext(
            self.workload,
            MODEL,
            req.keys,
            block_size=self.shape.block_size,
            session_id=req.session,
            now=now,
            exclude=exclude,
        )
        decision = self.policy.select(ctx, self.view)
        if self._prefill is not None and decision.ordinal is not None:
            self._count_prefill(req, decision.ordinal, now)
        record = decision.speculative
        if record is not None:
            self.index.add_speculative(record.replica, record.keys, expires_at=record.expires_at)
        ordinal = decision.ordinal if decision.ordinal is not None else 0
        self._tickets[req.rid] = self._ledger.sent(ordinal, now)
        self.board.put(self._state(ordinal))
        return ordinal

    def inflight(self) -> int:
        """This router's requests in flight, to any replica."""
        return self._ledger.total()

    def _count_prefill(self, req: Request, ordinal: int, now: float) -> None:
        """Book the prompt's tokens beyond the chosen replica's cached run (before this
        decision's speculative record) as prefill ``ordinal`` owes this router."""
        assert self._prefill is not None
        held = self.index.leading_runs(req.keys, now=now).get(ordinal, 0)
        uncached = req.prompt_tokens - held * self.shape.block_size
        self._prefill_tickets[req.rid] = self._prefill.sent(ordinal, uncached, now)

    def apply_residency(self, replica: int, stored: list[int], removed: list[int]) -> None:
        if stored:  # a delivery is stores, then the removals that followed them
            self.index.add(replica, stored)
        if removed:
            self.index.remove(replica, removed)

    def on_first_token(self, req: Request, now: float) -> None:
        ticket = self._prefill_tickets.pop(req.rid, None)
        if self._prefill is not None and ticket is not None:
            self._prefill.first_token(req.replica, ticket, now)
            self._now = now
            self.board.put(self._state(req.replica))

    def on_finished(self, req: Request, now: float) -> None:
        self._ledger.done(req.replica, self._tickets.pop(req.rid), now)
        self.board.put(self._state(req.replica))


class RandomRouter:
    """Uniformly random replicas: the baseline Mooncake and llm-d report against."""

    name = "random"
    wants_residency = False
    load_period_s = float("inf")

    def __init__(self, fleet: FleetReadout, seed: int) -> None:
        self._n = len(fleet.replicas)
        self._rng = random.Random(seed)

    def route(self, req: Request, now: float) -> int:
        del req, now
        return self._rng.randrange(self._n)

    def apply_residency(self, replica: int, stored: list[int], removed: list[int]) -> None:
        del replica, stored, removed

    def on_first_token(self, req: Request, now: float) -> None:
        del req, now

    def on_finished(self, req: Request, now: float) -> None:
        del req, now
