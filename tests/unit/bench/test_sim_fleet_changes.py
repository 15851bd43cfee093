"""bench/sim/fleet_changes.py on small fleets: what each mode promises holds."""

from __future__ import annotations

import dataclasses

from bench.sim.fleet_changes import SCENARIOS, Change, FleetScenario, run_fleet

SMALL = dict(groups=4, rate=6.0, output_tokens=32, system_tokens=2048, question_tokens=64)


def small_scale_out() -> FleetScenario:
    """4 -> 6 replicas at 15 s under SMALL's load."""
    return dataclasses.replace(
        SCENARIOS["scale_out"],
        changes=(Change(15.0, "add", 4), Change(15.0, "add", 5)),
        duration_s=45.0,
        transition=(15.0, 30.0),
        **SMALL,
    )


def test_warm_up_fills_joining_replicas_before_they_serve_and_nothing_is_lost() -> None:
    """Two replicas join together: each is warmed with its share of the hot prefixes
    (together every group once, not every group each), they reach the fleet's hit rate
    at once, and no request is lost."""
    scenario = small_scale_out()
    on = run_fleet(scenario, "on", seed=1)
    assert on.lost == 0
    assert on.warm_requests == SMALL["groups"]
    assert on.hit_catch_up_s[0] is not None and on.hit_catch_up_s[0] <= 4.0


def test_a_drain_loses_no_request_and_a_restart_rejoins() -> None:
    drain = dataclasses.replace(
        SCENARIOS["drain"], changes=(Change(10.0, "drain", 3),), duration_s=30.0,
        transition=(10.0, 20.0), **SMALL,
    )  # fmt: skip
    run = run_fleet(drain, "on", seed=2)
    assert run.lost == 0 and run.share_after[3] == 0.0
    restart = dataclasses.replace(
        SCENARIOS["rolling_restart"], changes=(Change(10.0, "restart", 0),), duration_s=40.0,
        transition=(10.0, 30.0), **SMALL,
    )  # fmt: skip
    run = run_fleet(restart, "on", seed=2)
    assert run.lost == 0 and run.share_after[0] > 0.1 and run.warm_requests >= 1


def test_the_bound_fills_joiners_at_the_prefill_pace_without_a_request() -> None:
    """Mode bound, the measure of what any warm-up could win: the same plan lands in the
    joiners' caches (their catch-up as quick as on's) and no warm-up request takes their
    steps, so their TTFT is no worse than on's."""
    scenario = small_scale_out()
    on, bound = run_fleet(scenario, "on", seed=1), run_fleet(scenario, "bound", seed=1)
    assert bound.lost == 0 and bound.warm_requests == 0
    assert bound.hit_catch_up_s[0] is not None and bound.hit_catch_up_s[0] <= 4.0
    assert bound.ttft_p90_s <= on.ttft_p90_s


def test_transfer_moves_the_prefixes_from_their_holders_and_recomputes_the_rest() -> None:
    """Mode transfer: each prefix some replica holds is moved (a one-token request there,
    then the joiner reads its blocks), so the joiners catch up as on's do; a replica
    fleet restarted all at once (no replica holds any prefix) recomputes them instead."""
    scenario = small_scale_out()
    moved = run_fleet(scenario, "transfer", seed=1)
    assert moved.lost == 0
    assert moved.transfers >= 2 * SMALL["groups"] - 2  # each joiner, (nearly) every group
    assert moved.warm_requests == 2 * moved.transfers  # a pair each, nothing recomputed
    assert moved.hit_catch_up_s[0] is not None and moved.hit_catch_up_s[0] <= 4.0
    together = dataclasses.replace(
        SCENARIOS["rolling_restart"], start_replicas=2, total_replicas=2,
        changes=(Change(10.0, "restart", 0), Change(10.0, "restart", 1)), duration_s=30.0,
        transition=(10.0, 25.0), **SMALL,
    )  # fmt: skip
    run = run_fleet(together, "transfer", seed=2)
    assert run.lost == 0 and run.transfers == 0 and run.warm_requests >= 1


def test_transfer_onto_a_saturated_fleet_serves_hits_on_the_joiners_at_once() -> None:
    """A scale-out of a saturated fleet (every holder has requests waiting, so a move
    waits seconds there for a slot): warmed by transfer, the joiners compute a prefix
    while idle and serve at the fleet's hit rate from their first 2-s window (3 windows
    from the scale-out; without it: none in 6 s at this seed)."""
    scenario = dataclasses.replace(SCENARIOS["scale_out"], duration_s=46.0, transition=(40.0, 46.0))
    run = run_fleet(scenario, "transfer", seed=3)
    assert run.lost == 0 and run.hit_catch_up_s == [0.0]
    assert run.warm_requests > 2 * run.transfers  # some computed by the joiners
