"""LoRA adapters in the simulator: adapter traffic, adapter slots per replica, and three
ways of routing it (issue 41 item 4's adapters scenario).

The workload (:class:`AdapterTraffic`): ``adapters`` adapters with Zipf popularity; each
request a prompt of its adapter's shared prefix (a system prompt or few-shot block, keyed
under the adapter: an adapter's blocks never serve another) and a unique question.

The replicas (:class:`AdapterSlots`): each keeps at most ``per_replica`` adapters loaded,
least recently used out; a request whose replica lacks its adapter waits ``load_s`` (0.5 s) for
the load first (as a vLLM or SGLang engine loading it through its API, or from its CPU
cache), which counts in its TTFT. At start adapter ``a`` is on replica ``a mod N``.

The contenders, each the real ``kvcore`` policy of :mod:`bench.sim.routers`:

- ``lora:<strategy>``: kvroute with the workload's ``lora_on_miss: load``, as
  ``dataplane.lora`` does: the adapter's holders only, scored by adapter-keyed residency;
  when none holds it or every holder is at ``lora_spread_load``, the other replicas
  (where it gets loaded);
- ``lora-miss:<strategy>``: the policy over every replica, loading whenever the chosen
  one lacks the adapter ("load on every miss"); ``lora-miss:round_robin`` is plain
  round-robin on such engines.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

from bench.sim.engine import EngineShape
from bench.sim.routers import KvrouteRouter
from bench.sim.simulator import FleetReadout, RunOutcome, SimConfig, SimRouter, Simulation
from bench.sim.workloads import KeySpace, Request, chained, poisson_times

LORA, LORA_MISS = "lora:", "lora-miss:"
_DELIVER = 10  # an event kind of its own: a request reaching its replica after a load


def is_lora(spec: str) -> bool:
    return spec.startswith((LORA, LORA_MISS))


@dataclass
class AdapterTraffic:
    """Requests for ``adapters`` adapters, Zipf(``zipf_s``) popular, Poisson arrivals."""

    adapters: int = 16
    requests: int = 2000
    rate: float = 80.0
    zipf_s: float = 1.1
    prefix_tokens: int = 1024  # the adapter's shared prefix
    question_tokens: int = 96
    output_tokens: int = 32
    block_size: int = 16
    seed: int = 1
    name: str = "adapters"
    adapter_of: dict[int, int] = field(default_factory=dict)  # request id -> adapter

    def arrivals(self) -> Iterator[Request]:
        rng = random.Random(self.seed)
        weights = [1 / (a + 1) ** self.zipf_s for a in range(self.adapters)]
        fresh = KeySpace(self.seed)
        prefix_blocks = self.prefix_tokens // self.block_size
        prefixes = [chained(0xADA9 << 32 | a, a, prefix_blocks) for a in range(self.adapters)]
        question_blocks = self.question_tokens // self.block_size
        times = poisson_times(self.rate, rng)
        for rid in range(self.requests):
            adapter = rng.choices(range(self.adapters), weights)[0]
            self.adapter_of[rid] = adapter
            yield Request(
                rid=rid,
                arrival=next(times),
                keys=[*prefixes[adapter], *fresh.fresh(question_blocks)],
                prompt_tokens=self.prefix_tokens + self.question_tokens + 3,
                output_tokens=self.output_tokens,
            )

    def follow_up(self, done: Request, now: float) -> Request | None:
        del done, now
        return None


class AdapterSlots:
    """The adapters each replica has loaded, least recently used first."""

    def __init__(self, replicas: int, adapters: int, per_replica: int, load_s: float) -> None:
        self.per_replica = per_replica
        self.load_s = load_s
        self.loaded: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(replicas)]
        for adapter in range(adapters):  # adapter a starts on replica a mod N, while room
            slots = self.loaded[adapter % replicas]
            if len(slots) < per_replica:
                slots[adapter] = 0.0  # ready since the start
        self.loads = 0

    def holders(self, adapter: int) -> set[int]:
        return {o for o, slots in enumerate(self.loaded) if adapter in slots}

    def use(self, ordinal: int, adapter: int, now: float) -> float:
        """When a request for ``adapter`` can start on ``ordinal``: at once if loaded
        (or when its load ends), else after a load that unloads the least recently used."""
        slots = self.loaded[ordinal]
        ready = slots.get(adapter)
        if ready is None:
            while len(slots) >= self.per_replica:
                slots.popitem(last=False)
            ready = now + self.load_s
            self.loads += 1
        slots[adapter] = ready
        slots.move_to_end(adapter)
        return max(ready, now)


class AdapterRouter:
    """One router instance of a ``lora*`` contender around a kvroute policy."""

    wants_residency = True

    def __init__(
        self,
        spec: str,
        slots: AdapterSlots,
        adapter_of: dict[int, int],
        fleet: FleetReadout,
        shape: EngineShape,
        seed: int,
        load_period_s: float,
    ) -> None:
        self.name = spec
        self.mode, _, inner = spec.partition(":")
        self.inner = KvrouteRouter(inner, fleet, shape, seed, load_period_s)
        self.load_period_s = load_period_s
        self.slots = slots
        self.adapter_of = adapter_of
        self._all = frozenset(range(len(fleet.replicas)))

    def route(self, req: Request, now: float) -> int:
        return self.inner.route(req, now, exclude=self._excluded(req))

    def _excluded(self, req: Request) -> frozenset[int]:
        """kvroute's adapter rule (``dataplane.lora``); the others exclude nothing."""
        if self.mode != LORA[:-1]:
            return frozenset()
        holders = self.slots.holders(self.adapter_of[req.rid])
        threshold = self.inner.workload.lora_spread_load
        board = self.inner.board
        if holders and any(board.at(o).load < threshold for o in holders):
            return self._all - holders  # its holders, scored as any request
        return frozenset(holders) if holders != self._all else frozenset()

    def apply_residency(self, replica: int, stored: list[int], removed: list[int]) -> None:
        self.inner.apply_residency(replica, stored, removed)

    def on_first_token(self, req: Request, now: float) -> None:
        self.inner.on_first_token(req, now)

    def on_finished(self, req: Request, now: float) -> None:
        self.inner.on_finished(req, now)


class LoraSimulation(Simulation):
    """A :class:`Simulation` whose requests wait for their adapter's load."""

    def __init__(
        self,
        config: SimConfig,
        workload: AdapterTraffic,
        spec: str,
        seed: int,
        *,
        per_replica: int = 4,
        load_s: float = 0.5,
    ) -> None:
        self.slots = AdapterSlots(config.replicas, workload.adapters, per_replica, load_s)
        adapter_of = workload.adapter_of

        def factory(fleet: FleetReadout, i: int) -> SimRouter:
            return AdapterRouter(
                spec, self.slots, adapter_of, fleet, config.shape, seed + i, config.load_period_s
            )

        super().__init__(config, workload, factory)
        self._adapter_of = adapter_of
        self._ids = itertools.count()

    def _arrive(self, req: Request, now: float) -> None:
        self.requests.append(req)
        router = self.routers[len(self.requests) % len(self.routers)]
        ordinal = router.route(req, now)
        req.replica = ordinal
        self._owner[req.rid] = router
        ready = self.slots.use(ordinal, self._adapter_of[req.rid], now)
        if ready > now:
            self._push(ready, _DELIVER, req)
        else:
            self.replicas[ordinal].arrive(req, now)

    def _dispatch(self, kind: int, payload: object, now: float) -> None:
        if kind == _DELIVER:
            req = cast(Request, payload)
            self.replicas[req.replica].arrive(req, now)
        else:
            super()._dispatch(kind, payload, now)

    def run(self) -> RunOutcome:
        outcome = super().run()
        outcome.adapter_loads = self.slots.loads
        return outcome
