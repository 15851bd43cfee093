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


def test_the_sim_kv_cost_router_books_prefill_until_the_first_token() -> None:
    from bench.sim.contenders import router_factory

    shape = EngineShape(num_blocks=4096)
    factory = router_factory("kv_cost", shape, seed=1, load_period_s=0.5)
    workload = SharedPrefix(groups=1, prompts_per_group=1)
    router = Simulation(SimConfig(replicas=2, shape=shape), workload, factory).routers[0]
    router.apply_residency(1, [99], [])  # an engine has reported: no cold-start fallback
    long = Request(0, 1.0, list(range(1000, 1500)), 8000, 8)  # 8,000 tokens, none cached
    long.replica = router.route(long, 1.0)
    assert router.view.replicas()[long.replica].queued_prefill_tokens == 8000
    short = Request(1, 1.5, list(range(5000, 5010)), 160, 8)
    short.replica = router.route(short, 1.5)
    assert short.replica != long.replica  # 3,000 tokens still ahead there at 10,000/s
    assert router.view.replicas()[long.replica].queued_prefill_tokens == 3000
    router.on_first_token(long, 1.9)
    assert router.view.replicas()[long.replica].queued_prefill_tokens == 0
