"""The decode replica of a disaggregated request: least loaded, and the prompt's holder
when it is nearly as free."""

from __future__ import annotations

from kvcore.decode_choice import LOAD_SLACK, DecodeCandidate, choose_decode


def test_no_decode_replica_is_no_choice() -> None:
    assert choose_decode([]) is None


def test_without_residency_the_least_loaded_replica_decodes() -> None:
    candidates = [DecodeCandidate(0, 0.50, 0.2), DecodeCandidate(1, 0.10, 0.9)]
    assert choose_decode(candidates) == 1


def test_equal_load_goes_to_the_replica_with_more_kv_headroom() -> None:
    candidates = [DecodeCandidate(0, 0.25, 0.8), DecodeCandidate(1, 0.25, 0.3)]
    assert choose_decode(candidates) == 1


def test_a_replica_holding_the_prompt_wins_when_nearly_as_free() -> None:
    # it already holds 40 of the prompt's blocks: a read of the rest only
    holder = DecodeCandidate(0, 0.10 + LOAD_SLACK / 2, 0.5, resident_blocks=40)
    idle = DecodeCandidate(1, 0.10, 0.1)
    assert choose_decode([holder, idle]) == 0


def test_the_longer_held_run_wins_among_holders() -> None:
    candidates = [
        DecodeCandidate(0, 0.2, 0.1, resident_blocks=8),
        DecodeCandidate(1, 0.2, 0.5, resident_blocks=32),
    ]
    assert choose_decode(candidates) == 1


def test_a_busy_holder_loses_to_an_idle_replica() -> None:
    # holding the prompt saves a transfer, not the decode latency of a crowded replica
    holder = DecodeCandidate(0, 0.10 + 2 * LOAD_SLACK, 0.5, resident_blocks=64)
    idle = DecodeCandidate(1, 0.10, 0.1)
    assert choose_decode([holder, idle]) == 1


def test_a_fleet_reporting_no_residency_is_picked_by_load_and_headroom_alone() -> None:
    """SGLang's decode servers at their defaults publish nothing: each pick goes to the
    least loaded, and as picks load it, the next to the other (no replica preferred)."""
    loads = {0: 0.0, 1: 0.0, 2: 0.0}
    picks = []
    for _ in range(6):
        ordinal = choose_decode([DecodeCandidate(o, load, 0.1) for o, load in loads.items()])
        assert ordinal is not None
        picks.append(ordinal)
        loads[ordinal] += 0.25  # a seat of four taken
    assert picks == [0, 1, 2, 0, 1, 2]
