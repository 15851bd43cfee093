"""Disaggregated prefill/decode in the simulator: prefill and decode pools, routed in pairs.

A P/D contender's fleet is ``SimConfig.prefill_replicas`` prefill replicas and the rest
decode replicas, of the same shape; the colocated contenders of the same scenario run on
all of them as ``both``. One request goes, as vLLM's disaggregated serving runs it:

1. to a prefill replica, as a one-token request: its prompt is computed there (the
   prefill replica's cache, events and queue as for any request), and its blocks stay
   cached there;
2. once the prefill is done, to a decode replica, which reads the prompt's KV (a transfer
   of ``SimConfig.kv_transfer_block_s`` per block it does not already hold, as vLLM's
   connector reads only the blocks beyond the decode side's own cached prefix; the
   blocks it reads are cached there and published like any) and generates every output
   token. The client's first token is the decode replica's first.

That decode is vLLM's, or SGLang's started with ``--disaggregation-decode-enable-radix-cache``;
SGLang's default decode server (no prefix cache: it reads every block and publishes
nothing, ``enginesim/pd.py``) is not modelled here. What is not modelled either: the
prefill's blocks held until they are read (the transfer is
milliseconds), SGLang's decode side reserving its KV while the prefill runs, and the
interference of prefill with decode that disaggregation removes on real GPUs (the step
model of :mod:`bench.sim.engine` already charges a colocated replica's decode batch for
every prefill it admits, so that part is modelled).

Contenders (specs):

- ``pd:STRATEGY[:field=value,...]``: kvroute's proxy (``dataplane/pd.py``): the prefill
  replica by the real ``kvcore`` policy over the prefill pool (:class:`KvrouteRouter`),
  the decode replica by :func:`kvcore.decode_choice.choose_decode` on the decode pool's
  sampled load, this router's decode sends since, KV usage and the decode replicas'
  reported residency;
- ``pd-load:STRATEGY...``: the same with the decode pool's residency ignored (load and
  KV headroom only), to show what the residency rule adds;
- ``smg-pd:cache_aware``: smg 1.13's PD router at its defaults (``--pd-disaggregation
  --policy cache_aware``): two independent ``cache_aware`` policies (``create_pd_router``
  makes one for each leg from the same config), one over the prefill workers and one
  over the decode workers, each with its own approximate tree of the request text and
  its own in-flight counts (a prefill's count ends with the prefill's answer, a decode's
  with the stream); ``--cache-threshold 0.3``, ``--balance-abs-threshold 64``,
  ``--balance-rel-threshold 1.5``, eviction every 60 s (its KV-usage spill triggers are
  off by default).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, cast

from bench.sim.engine import EngineShape, Publish, ReplicaModel, Schedule
from bench.sim.peers import CacheAwareDefaults, CacheAwareRouter
from bench.sim.routers import KvrouteRouter, is_kvroute, parse_spec
from bench.sim.simulator import (
    ARRIVAL,
    WAKE,
    FleetReadout,
    RunClock,
    RunOutcome,
    SimConfig,
    drain,
    residency_batches,
    shared_event,
    too_large,
)
from bench.sim.workloads import Request, Workload
from enginesim.kv_manager import PoolEvent
from kvcore.decode_choice import DecodeCandidate, choose_decode
from kvcore.index import BitmaskResidencyIndex
from kvcore.policies import InflightLedger, ReplicaState

PD, PD_LOAD, SMG_PD = "pd:", "pd-load:", "smg-pd:cache_aware"
SMG = CacheAwareDefaults(0.3, 64, 1.5, 60.0, 2**26)  # smg 1.13's launch defaults


def is_pd(spec: str) -> bool:
    return spec.startswith((PD, PD_LOAD)) or spec == SMG_PD


def check_pd_spec(spec: str) -> None:
    """``ValueError`` for a P/D spec whose prefill strategy is unknown."""
    if spec.startswith((PD, PD_LOAD)):
        inner = spec.partition(":")[2]
        if not is_kvroute(inner):
            raise ValueError(f"policy {spec!r}: {inner!r} is not a kvroute strategy")
        parse_spec(inner)


class PdRouter(Protocol):
    """One P/D router instance as :class:`PdSimulation` drives it."""

    name: str

    def route(self, req: Request, now: float) -> tuple[int, int]:
        """(prefill ordinal, decode ordinal), each in its own pool."""
        ...

    def apply_residency(
        self, pool: str, replica: int, stored: list[int], removed: list[int]
    ) -> None:
        """Engine events of ``replica`` of ``pool`` ("prefill" or "decode")."""
        ...

    def on_prefilled(self, req: Request, now: float) -> None:
        """``req``'s prefill answered (its KV is ready for the decode replica)."""
        ...

    def on_finished(self, req: Request, now: float) -> None:
        """``req``'s decode replica sent its last token."""
        ...


class KvroutePdRouter:
    """kvroute's proxy over a P/D pool: the prefill by a real policy, the decode by
    :func:`choose_decode`."""

    def __init__(
        self,
        spec: str,
        prefill: FleetReadout,
        decode: FleetReadout,
        shape: EngineShape,
        seed: int,
        load_period_s: float,
    ) -> None:
        self.name = spec
        self.by_residency = spec.startswith(PD)
        self.prefill = KvrouteRouter(spec.partition(":")[2], prefill, shape, seed, load_period_s)
        self.decode = decode
        self.shape = shape
        self.load_period_s = load_period_s
        self.decode_index = BitmaskResidencyIndex()
        self._ledger = InflightLedger()
        self._tickets: dict[int, tuple[int, int]] = {}  # rid -> (decode ordinal, ticket)
        self._taken_at = -1e18

    def route(self, req: Request, now: float) -> tuple[int, int]:
        p = self.prefill.route(req, now)
        d = self._decode(req, now)
        self._tickets[req.rid] = (d, self._ledger.sent(d, now))
        return p, d

    def _decode(self, req: Request, now: float) -> int:
        if self.decode.sampled_at - self._taken_at >= self.load_period_s - 1e-9:
            self._taken_at = self.decode.sampled_at
        runs = self.decode_index.leading_runs(req.keys, now=now) if self.by_residency else {}
        candidates = []
        for d, sample in enumerate(self.decode.samples):
            state = ReplicaState(
                d,
                f"decode-{d}",
                running=sample.running,
                waiting=sample.waiting,
                kv_usage=sample.kv_usage,
                unreported=self._ledger.unreported(d, self._taken_at),
                capacity=self.shape.max_num_seqs,
            )
            candidates.append(DecodeCandidate(d, state.load, state.kv_usage, runs.get(d, 0)))
        chosen = choose_decode(candidates)
        assert chosen is not None  # the pool has decode replicas
        return chosen

    def apply_residency(
        self, pool: str, replica: int, stored: list[int], removed: list[int]
    ) -> None:
        if pool == "prefill":
            self.prefill.apply_residency(replica, stored, removed)
            return
        if stored:
            self.decode_index.add(replica, stored)
        if removed:
            self.decode_index.remove(replica, removed)

    def on_prefilled(self, req: Request, now: float) -> None:
        self.prefill.on_first_token(req, now)
        self.prefill.on_finished(req, now)

    def on_finished(self, req: Request, now: float) -> None:
        d, ticket = self._tickets.pop(req.rid)
        self._ledger.done(d, ticket)


class SmgPdRouter:
    """smg's PD router with ``cache_aware`` for both legs (see the module docstring)."""

    def __init__(self, prefill: FleetReadout, decode: FleetReadout, shape: EngineShape) -> None:
        self.name = SMG_PD
        self.prefill = CacheAwareRouter("prefill", SMG, prefill, shape)
        self.decode = CacheAwareRouter("decode", SMG, decode, shape)
        self._decode_of: dict[int, int] = {}

    def route(self, req: Request, now: float) -> tuple[int, int]:
        p = self.prefill.route(req, now)
        d = self.decode.route(req, now)
        self._decode_of[req.rid] = d
        return p, d

    def apply_residency(
        self, pool: str, replica: int, stored: list[int], removed: list[int]
    ) -> None:
        del pool, replica, stored, removed  # its trees are of what it sent, not the engines'

    def on_prefilled(self, req: Request, now: float) -> None:
        self.prefill.on_finished(req, now)  # req.replica: the prefill replica

    def on_finished(self, req: Request, now: float) -> None:
        self.decode.load[self._decode_of.pop(req.rid)] -= 1


class DecodeReplica(ReplicaModel):
    """A decode replica: a request's prompt arrives computed (read from its prefill), so
    its admission costs no prefill; the blocks it read are cached as computed ones."""

    def __init__(
        self, ordinal: int, shape: EngineShape, schedule: Schedule, publish: Publish
    ) -> None:
        timing = replace(shape.timing, prefill_overhead_s=0.0)
        super().__init__(ordinal, replace(shape, timing=timing), schedule, publish)

    def _admit(self, now: float) -> list[Request]:
        admitted = super()._admit(now)
        for req in admitted:
            req.cached_tokens = req.prompt_tokens  # all of it read, none computed here
        return admitted


_RESIDENCY, _DECODE = 2, 3  # and simulator's ARRIVAL (0) and WAKE (1)


@dataclass(slots=True)
class _Flight:
    """One client request in flight: its halves and the router that sent it."""

    req: Request
    prefill: Request
    decode: int
    router: PdRouter


class PdSimulation:
    """One workload through P/D router instances onto a fresh prefill and decode pool."""

    def __init__(self, config: SimConfig, workload: Workload, spec: str, seed: int) -> None:
        prefills = config.prefill_replicas
        if not 0 < prefills < config.replicas:
            raise ValueError(f"a P/D run needs 0 < prefill_replicas < replicas ({config})")
        self.config = config
        self.workload = workload
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        shape = config.shape
        self.prefills = [
            ReplicaModel(i, shape, self._schedule, self._publisher("prefill"))
            for i in range(prefills)
        ]
        self.decodes = [
            DecodeReplica(i, shape, self._schedule, self._publisher("decode"))
            for i in range(config.replicas - prefills)
        ]
        for replica in self.prefills:
            replica.finished_callback = self._prefilled
        for replica in self.decodes:
            replica.first_token_callback = self._first_token
            replica.finished_callback = self._finished
        self.readouts = FleetReadout(self.prefills), FleetReadout(self.decodes)
        self.routers = [
            self._router(spec, seed + i, config) for i in range(config.router_instances)
        ]
        self._flights: dict[int, _Flight] = {}
        self.requests: list[Request] = []
        self.rejected = 0
        self._decide_s = 0.0

    def _router(self, spec: str, seed: int, config: SimConfig) -> PdRouter:
        prefill, decode = self.readouts
        if spec == SMG_PD:
            return SmgPdRouter(prefill, decode, config.shape)
        check_pd_spec(spec)
        return KvroutePdRouter(spec, prefill, decode, config.shape, seed, config.load_period_s)

    # -- events --------------------------------------------------------------------------

    def _push(self, at: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, payload))

    def _schedule(self, at: float, replica: ReplicaModel, step: int, version: int) -> None:
        self._push(at, WAKE, (replica, step, version))

    def _publisher(self, pool: str) -> Publish:
        def publish(replica: int, events: list[PoolEvent], at: float) -> None:
            self._push(at + self.config.residency_delay_s, _RESIDENCY, (pool, replica, events))

        return publish

    def _deliver(self, pool: str, replica: int, events: list[PoolEvent]) -> None:
        for stored, removed in residency_batches(events):
            for router in self.routers:
                router.apply_residency(pool, replica, stored, removed)

    def _arrive(self, req: Request, now: float) -> None:
        self.requests.append(req)
        if too_large(req, self.config.shape):
            self.rejected += 1
            return
        router = self.routers[len(self.requests) % len(self.routers)]
        started = time.perf_counter()
        p, d = router.route(req, now)
        self._decide_s += time.perf_counter() - started
        half = Request(req.rid, now, req.keys, req.prompt_tokens, 1, req.session)
        half.replica = req.replica = p
        self._flights[req.rid] = _Flight(req, half, d, router)
        self.prefills[p].arrive(half, now)

    def _prefilled(self, half: Request, now: float) -> None:
        """The prefill answered: the decode replica reads what it lacks, then queues it."""
        flight = self._flights[half.rid]
        req = flight.req
        req.cached_tokens = half.cached_tokens  # the prefill side's hit, as engines report
        flight.router.on_prefilled(half, now)
        decode = self.decodes[flight.decode]
        bs = self.config.shape.block_size
        held = decode.pool.longest_cached_prefix(cast(Sequence[bytes], req.keys))
        to_read = -(-req.prompt_tokens // bs) - len(held)
        second = Request(
            req.rid, now, req.keys, req.prompt_tokens, req.output_tokens, req.session,
            req.seq_keys, req.turn,
        )  # fmt: skip
        second.replica = flight.decode
        self._push(now + to_read * self.config.kv_transfer_block_s, _DECODE, second)

    def _first_token(self, second: Request, at: float) -> None:
        self._flights[second.rid].req.first_token_at = at

    def _finished(self, second: Request, now: float) -> None:
        flight = self._flights.pop(second.rid)
        flight.req.finished_at = now
        flight.router.on_finished(flight.req, now)
        follow = self.workload.follow_up(flight.req, now)
        if follow is not None:
            self._push(follow.arrival, ARRIVAL, follow)

    def run(self) -> RunOutcome:
        started = RunClock.start()
        arrivals = self.workload.arrivals()
        end = drain(arrivals, self._heap, self.config.load_period_s, self._sample, self._dispatch)
        replicas = [*self.prefills, *self.decodes]
        return RunOutcome.of(replicas, self.requests, self.rejected, self._decide_s, started, end)

    def _sample(self, now: float) -> None:
        for readout in self.readouts:
            readout.sample(now)

    def _dispatch(self, kind: int, payload: object, now: float) -> None:
        if shared_event(kind, payload, now, self._arrive):
            return
        if kind == _DECODE:
            second = cast(Request, payload)
            self.decodes[second.replica].arrive(second, now)
        elif kind == _RESIDENCY:
            pool, ordinal, events = cast(tuple[str, int, list[PoolEvent]], payload)
            self._deliver(pool, ordinal, events)
