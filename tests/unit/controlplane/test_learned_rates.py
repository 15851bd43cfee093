"""The proxies' learned prefill rates as ``/v1/replicas`` shows them
(``controlplane.fleet.learned_rates``): medians over the proxies that reported lately."""

from __future__ import annotations

from controlplane.fleet.learned_rates import LearnedRates
from kvcore.pb import routing_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def report(proxy: str, ts: float, *rates: routing_pb2.LearnedRate) -> routing_pb2.ProxyReport:
    return routing_pb2.ProxyReport(proxy_id=proxy, ts=ts, learned_rates=rates)


def rate(
    replica: str, ranked: float, line: float = 0.0, slowness: float = 0.0, engine: float = 0.0
) -> routing_pb2.LearnedRate:
    fixed = 0.02 if line else 0.0
    return routing_pb2.LearnedRate(
        replica_id=replica,
        prefill_tokens_per_s=ranked,
        line_tokens_per_s=line,
        line_fixed_s=fixed,
        slowness=slowness,
        engine_tokens_per_s=engine,
    )


def test_the_median_over_the_proxies_and_how_many() -> None:
    learned = LearnedRates(clock=Clock())
    learned.on_report(report("p1", 1.0, rate("r0", 2000, 2000, 1.0), rate("r1", 500, 0, 4.0)))
    learned.on_report(report("p2", 1.0, rate("r0", 3000, 3000, 1.1, 7000)))
    learned.on_report(report("p3", 1.0, rate("r0", 2500, 0, 0.9, 7200)))
    assert learned.state_of("r0") == {
        "prefill_tokens_per_s": 2500.0,
        "line_tokens_per_s": 2500.0,  # the two proxies with a line of their own
        "line_fixed_s": 0.02,
        "slowness": 1.0,
        "engine_tokens_per_s": 7100.0,  # the two keeping the engines' figures
        "proxies": 3,
    }
    assert learned.state_of("r1") == {
        "prefill_tokens_per_s": 500.0,
        "line_tokens_per_s": None,
        "line_fixed_s": None,
        "slowness": 4.0,
        "engine_tokens_per_s": None,
        "proxies": 1,
    }
    assert learned.state_of("r9") is None  # nothing learned: null


def test_a_proxys_latest_report_replaces_its_figures_and_quiet_ones_age_out() -> None:
    clock = Clock()
    learned = LearnedRates(max_age_s=60, clock=clock)
    learned.on_report(report("p1", 10.0, rate("r0", 2000, 2000)))
    learned.on_report(report("p1", 5.0, rate("r0", 9000, 9000)))  # older, delivered late
    learned.on_report(report("p1", 11.0))  # nothing learned in it (a hot-prefix copy)
    state = learned.state_of("r0")
    assert state is not None and state["prefill_tokens_per_s"] == 2000.0
    clock.now += 30
    learned.on_report(report("p1", 40.0, rate("r1", 700, 0, 3.0)))  # r0 forgotten there
    learned.on_report(report("p2", 40.0, rate("r0", 1000, 1000)))
    assert learned.state_of("r0") == {
        "prefill_tokens_per_s": 1000.0,
        "line_tokens_per_s": 1000.0,
        "line_fixed_s": 0.02,
        "slowness": None,
        "engine_tokens_per_s": None,
        "proxies": 1,
    }
    clock.now += 61  # neither proxy has reported for a minute
    assert learned.state_of("r0") is None and learned.state_of("r1") is None
