"""What routers hear back from the simulated fleet, and when (a router's books are only
as good as the timing of what it is told)."""

from __future__ import annotations

from bench.sim.engine import EngineShape
from bench.sim.simulator import FleetReadout, SimConfig, Simulation
from bench.sim.workloads import Request, SharedPrefix


class _Recorder:
    """Sends everything to replica 0 and records when it hears of each first token."""

    name = "recorder"
    wants_residency = False
    load_period_s = float("inf")

    def __init__(self, fleet: FleetReadout, instance: int) -> None:
        del fleet, instance
        self.heard: list[tuple[Request, float]] = []
        self.clock: list[float] = []  # the time of every call, in call order

    def route(self, req: Request, now: float) -> int:
        del req
        self.clock.append(now)
        return 0

    def apply_residency(self, replica: int, stored: list[int], removed: list[int]) -> None:
        del replica, stored, removed

    def on_first_token(self, req: Request, now: float) -> None:
        self.heard.append((req, now))
        self.clock.append(now)

    def on_finished(self, req: Request, now: float) -> None:
        del req, now


def test_a_router_hears_of_a_first_token_when_it_is_produced_not_when_prefill_starts() -> None:
    workload = SharedPrefix(groups=2, prompts_per_group=3, system_tokens=4096, rate=50.0)
    routers: list[_Recorder] = []

    def factory(fleet: FleetReadout, instance: int) -> _Recorder:
        routers.append(_Recorder(fleet, instance))
        return routers[-1]

    Simulation(SimConfig(replicas=1, shape=EngineShape(num_blocks=4096)), workload, factory).run()
    heard, clock = routers[0].heard, routers[0].clock
    assert len(heard) == 6
    for req, at in heard:
        assert at == req.first_token_at > req.arrival  # told at the token's time
    # requests arrive every ~20 ms and a 4k-token prefill takes ~0.4 s, so the router is
    # asked to route while a prefill runs: it must not have heard of its end yet
    assert clock == sorted(clock)
