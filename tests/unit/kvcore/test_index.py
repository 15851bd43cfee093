"""Residency index conformance: every implementation behaves the same, checked here."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane import native
from kvcore.index import (
    MAX_REPLICA_ORDINAL,
    BitmaskResidencyIndex,
    CompactResidencyIndex,
    ReferenceResidencyIndex,
    ResidencyIndex,
    bitmask,
)


def numpy_compact() -> CompactResidencyIndex:
    """The compact index without its C lookup (a checkout with no compiler): short
    prompts key by key, long ones by numpy."""
    index = CompactResidencyIndex()
    index.native = None
    return index


def vectorised_compact() -> CompactResidencyIndex:
    """The compact index reading even a one-key prompt by its numpy array path, and
    applying the changes it holds back as soon as it holds four keys."""
    index = numpy_compact()
    index.scalar_keys = 0
    index.held_keys = 4
    return index


def proxy_compact() -> CompactResidencyIndex:
    """The compact index as a proxy holds it: every change applied at once (in C where
    built, as the changes held back by the default are when applied)."""
    return CompactResidencyIndex(hold_changes=False)


def stepwise_compact() -> CompactResidencyIndex:
    """The proxy's, moving a table it rebuilds three slots a change: reads and changes
    meet both tables for long, and a growing table's room runs out before its move ends
    (where the C is built; else as ``numpy_compact``)."""
    index = proxy_compact()
    index.migrate_slots, index.moved_per_key = 3, 0
    return index


# (CompactResidencyIndex reads prompts and applies changes in C where it is built: make
# native, make check)
FAST: list[Callable[[], Any]] = [
    BitmaskResidencyIndex,
    CompactResidencyIndex,
    proxy_compact,
    stepwise_compact,
    numpy_compact,
    vectorised_compact,
]
IMPLEMENTATIONS: list[Callable[[], ResidencyIndex]] = [*FAST, ReferenceResidencyIndex]
BIG = 2**64 - 1  # keys are unsigned 64-bit


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda f: f.__name__)
def index(request: pytest.FixtureRequest) -> ResidencyIndex:
    return request.param()  # type: ignore[no-any-return]


def test_add_and_lookup_holders(index: ResidencyIndex) -> None:
    index.add(0, [1, 2, BIG])
    index.add(5, [2])
    assert index.replicas_of(2) == {0, 5}
    assert index.replicas_of(BIG) == {0}
    assert index.replicas_of(99) == frozenset()
    assert (index.key_count(), index.key_count(0), index.key_count(5)) == (3, 3, 1)


def test_holdings_and_keys_of_list_confirmed_residency_for_snapshots(
    index: ResidencyIndex,
) -> None:
    index.add(0, [1, 2])
    index.add(3, [2, BIG])
    index.add_speculative(5, [7], expires_at=10.0)
    assert dict(index.holdings()) == {1: 0b1, 2: 0b1001, BIG: 0b1000}
    assert sorted(index.keys_of(3)) == [2, BIG]
    assert index.keys_of(5) == []


def test_adding_twice_counts_once(index: ResidencyIndex) -> None:
    index.add(1, [7, 7, 8])
    index.add(1, [7])
    assert index.key_count(1) == 2


def test_changes_before_a_read_end_as_the_last_one_of_each_key_says(
    index: ResidencyIndex,
) -> None:
    index.add(1, [5, 6])
    index.remove(1, [5, 9])
    index.add(2, [5])
    index.remove(1, [6])
    index.add(1, [6, 6])
    index.remove(2, [7])
    assert dict(index.holdings()) == {5: 0b100, 6: 0b10}
    assert (index.key_count(1), index.key_count(2), index.key_count()) == (1, 1, 2)


def test_remove_drops_only_that_replica(index: ResidencyIndex) -> None:
    index.add(0, [1, 2])
    index.add(1, [1])
    index.remove(0, [1, 404])
    assert index.replicas_of(1) == {1}
    assert index.replicas_of(2) == {0}
    index.remove(1, [1])
    assert index.replicas_of(1) == frozenset()
    assert index.key_count() == 1 and index.key_count(0) == 1 and index.key_count(1) == 0


def test_clear_replica_forgets_confirmed_and_speculative(index: ResidencyIndex) -> None:
    index.add(0, [1, 2, 3])
    index.add(1, [1, 2])
    index.add_speculative(0, [9], expires_at=100.0)
    assert index.clear_replica(0) == 3
    assert index.replicas_of(1) == {1}
    assert index.key_count() == 2
    assert index.leading_runs([9], now=0.0) == {}
    assert index.clear_replica(7) == 0


def test_clearing_step_by_step_hides_the_replica_from_the_first_step(
    index: ResidencyIndex,
) -> None:
    index.add(0, range(100))
    index.add(1, range(50))
    steps = index.clear_replica_steps(0, chunk=10)
    next(steps)
    assert index.leading_runs(list(range(100))) == {1: 50}
    assert index.replicas_of(5) == {1}
    assert index.keys_of(0) == [] and index.key_count(0) == 0
    assert dict(index.holdings()) == {k: 0b10 for k in range(50)}
    list(steps)
    assert index.key_count() == 50


def test_adding_to_a_replica_being_cleared_finishes_the_clear_first(index: ResidencyIndex) -> None:
    index.add(0, range(100))
    steps = index.clear_replica_steps(0, chunk=10)
    next(steps)
    index.add(0, [500, 501])
    assert sorted(index.keys_of(0)) == [500, 501]
    assert index.leading_runs([500, 501]) == {0: 2}
    assert index.leading_runs([3]) == {}
    assert index.key_count() == 2 and index.key_count(0) == 2
    list(steps)  # finishing a superseded job changes nothing
    assert sorted(index.keys_of(0)) == [500, 501]


def test_leading_runs_count_each_replicas_prefix(index: ResidencyIndex) -> None:
    index.add(0, [10, 11, 12, 13])
    index.add(1, [10, 11])
    index.add(2, [11, 12, 13])  # holds later blocks but not the first: no run
    index.add(3, [10, 12, 13])  # a gap ends the run
    assert index.leading_runs([10, 11, 12, 13, 14]) == {0: 4, 1: 2, 3: 1}
    assert index.leading_runs([99, 10]) == {}
    assert index.leading_runs([]) == {}


def test_leading_runs_cover_the_whole_prompt(index: ResidencyIndex) -> None:
    keys = list(range(512))
    index.add(63, keys)
    index.add(2, keys[:100])
    assert index.leading_runs(keys) == {63: 512, 2: 100}


def test_ordinals_beyond_64_work(index: ResidencyIndex) -> None:
    index.add(MAX_REPLICA_ORDINAL, [1, 2])
    index.add(64, [1])
    assert index.leading_runs([1, 2]) == {MAX_REPLICA_ORDINAL: 2, 64: 1}


@pytest.mark.parametrize("bad", [-1, MAX_REPLICA_ORDINAL + 1])
def test_invalid_ordinals_are_refused(index: ResidencyIndex, bad: int) -> None:
    with pytest.raises(ValueError, match="replica ordinal"):
        index.add(bad, [1])
    with pytest.raises(ValueError, match="replica ordinal"):
        index.add_speculative(bad, [1], expires_at=1.0)


def test_speculative_entries_count_only_when_asked_and_until_expiry(
    index: ResidencyIndex,
) -> None:
    index.add(0, [1])
    index.add_speculative(1, [1, 2, 3], expires_at=10.0)
    assert index.leading_runs([1, 2, 3]) == {0: 1}  # confirmed only
    assert index.leading_runs([1, 2, 3], now=5.0) == {0: 1, 1: 3}
    assert index.replicas_of(2) == frozenset()  # speculative is kept apart
    assert index.key_count() == 1
    assert index.leading_runs([1, 2, 3], now=10.0) == {0: 1}


def test_speculative_refresh_extends_expiry(index: ResidencyIndex) -> None:
    index.add_speculative(1, [1, 2], expires_at=10.0)
    index.add_speculative(1, [1], expires_at=20.0)
    assert index.expire(15.0) == 1
    assert index.leading_runs([1, 2], now=15.0) == {1: 1}
    assert index.expire(20.0) == 1
    assert index.leading_runs([1], now=20.0) == {}


def test_speculative_and_confirmed_combine_into_one_run(index: ResidencyIndex) -> None:
    index.add(4, [1, 2])
    index.add_speculative(4, [3], expires_at=5.0)
    assert index.leading_runs([1, 2, 3, 4], now=1.0) == {4: 3}


def test_speculative_count_is_each_replicas_unexpired_speculation(index: ResidencyIndex) -> None:
    index.add(0, [1, 2, 3])
    index.add_speculative(0, [3, 4], expires_at=10.0)
    index.add_speculative(0, [4], expires_at=20.0)
    index.add_speculative(1, [1], expires_at=10.0)
    assert (index.speculative_count(0, now=5.0), index.speculative_count(1, now=5.0)) == (2, 1)
    assert (index.speculative_count(0, now=10.0), index.speculative_count(1, now=10.0)) == (1, 0)
    assert index.speculative_count(7, now=5.0) == 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "spec", "clear", "expire", "step"]),
        st.integers(0, 70),
        st.lists(st.integers(0, 12), max_size=8),
        st.integers(0, 20),
    ),
    max_size=40,
)


@pytest.mark.parametrize("make", FAST, ids=lambda f: f.__name__)
@settings(max_examples=150, deadline=None)
@given(ops=OPS, probe=st.lists(st.integers(0, 12), max_size=10), now=st.integers(0, 20))
def test_fast_indexes_agree_with_the_reference(
    make: Callable[[], ResidencyIndex],
    ops: list[tuple[str, int, list[int], int]],
    probe: list[int],
    now: int,
) -> None:
    fast, oracle = make(), ReferenceResidencyIndex()
    for impl in (fast, oracle):
        for op, replica, keys, when in ops:
            _apply(impl, op, replica, keys, when)
    assert fast.leading_runs(probe) == oracle.leading_runs(probe)
    assert fast.leading_runs(probe, now=now) == oracle.leading_runs(probe, now=now)
    assert len(dict(fast.holdings())) == oracle.key_count()
    for replica in range(71):
        assert fast.key_count(replica) == oracle.key_count(replica)
        assert fast.speculative_count(replica, now=now) == oracle.speculative_count(
            replica, now=now
        )
    assert all(fast.replicas_of(k) == oracle.replicas_of(k) for k in range(13))
    assert dict(fast.holdings()) == dict(oracle.holdings())


PREFIXES = st.lists(  # (replica, how much of the prompt it holds, blocks missing from it)
    st.tuples(st.integers(0, 70), st.integers(0, 40), st.lists(st.integers(0, 40), max_size=6)),
    max_size=12,
)


@pytest.mark.parametrize("make", FAST, ids=lambda f: f.__name__)
@settings(max_examples=150, deadline=None)
@given(confirmed=PREFIXES, speculated=PREFIXES, length=st.integers(0, 40))
def test_leading_runs_of_long_prompts_agree_with_the_reference(
    make: Callable[[], ResidencyIndex],
    confirmed: list[tuple[int, int, list[int]]],
    speculated: list[tuple[int, int, list[int]]],
    length: int,
) -> None:
    """Replicas holding prefixes of one prompt, some with holes: the holder masks along
    it change a few times or many (past the bitmask index's walk of equal runs)."""
    fast, oracle = make(), ReferenceResidencyIndex()
    for impl in (fast, oracle):
        for replica, held, holes in confirmed:
            impl.add(replica, [k for k in range(held) if k not in holes])
        for replica, held, holes in speculated:
            impl.add_speculative(
                replica, [k for k in range(held) if k not in holes], expires_at=9.0
            )
    prompt = list(range(length))
    assert fast.leading_runs(prompt) == oracle.leading_runs(prompt)
    assert fast.leading_runs(prompt, now=1.0) == oracle.leading_runs(prompt, now=1.0)


def test_leading_runs_when_the_holders_change_at_every_block(index: ResidencyIndex) -> None:
    index.add(0, range(30))
    index.add(1, range(0, 30, 2))  # every other block: the masks alternate
    index.add(2, range(20))
    index.add(3, [0])
    assert index.leading_runs(list(range(40))) == {0: 30, 1: 1, 2: 20, 3: 1}


def test_records_out_of_order_of_expiry_expire_at_their_own_time(index: ResidencyIndex) -> None:
    """A shorter TTL recorded after a longer one (two workloads on one proxy)."""
    index.add_speculative(0, [1, 2], expires_at=10.0)
    index.add_speculative(1, [3], expires_at=4.0)  # earlier than the one before it
    index.add_speculative(0, [4], expires_at=12.0)
    index.add_speculative(1, [2], expires_at=6.0)
    assert index.expire(4.0) == 1
    assert index.leading_runs([3], now=4.0) == {}
    assert index.expire(6.0) == 1
    assert index.leading_runs([1, 2], now=6.0) == {0: 2}
    assert index.expire(10.0) == 2
    assert index.leading_runs([4], now=10.0) == {0: 1}
    assert index.expire(12.0) == 1
    assert index.speculative_count(0, now=12.0) == 0


def test_a_long_record_superseded_in_part_drops_only_the_keys_not_recorded_again(
    index: ResidencyIndex,
) -> None:
    prompt = list(range(512))
    index.add_speculative(2, prompt, expires_at=5.0)
    index.add_speculative(2, [*prompt[:500], 7, 7], expires_at=9.0)  # a key listed twice
    assert index.expire(5.0) == 12
    assert index.leading_runs(prompt, now=5.0) == {2: 500}
    assert index.expire(9.0) == 500
    assert index.speculative_count(2, now=9.0) == 0


def test_records_with_one_expiry_expire_together_and_keep_keys_recorded_since(
    index: ResidencyIndex,
) -> None:
    index.add_speculative(0, [1, 2], expires_at=5.0)
    index.add_speculative(0, [3], expires_at=5.0)  # same replica and expiry: one record
    index.add_speculative(1, [1], expires_at=5.0)
    index.add_speculative(0, [2], expires_at=7.0)  # moved on before the record expires
    assert index.expire(5.0) == 3
    assert index.leading_runs([2], now=5.0) == {0: 1}
    assert index.leading_runs([1], now=5.0) == {}
    index.add_speculative(0, [4], expires_at=5.0)  # already past, after its record went
    assert index.expire(5.0) == 1
    assert index.expire(7.0) == 1
    assert index.speculative_count(0, now=7.0) == 0


def test_a_busy_proxys_speculation_within_a_tick_keeps_one_record_per_replica() -> None:
    """A proxy at thousands of requests a second records the same prefixes over and over
    (its keys freshly hashed each time): within one expiry tick its memory stays flat
    instead of keeping every request's keys for the whole TTL."""
    index = BitmaskResidencyIndex()
    prompts = [[1000 * p + k for k in range(3)] for p in range(8)]
    for request in range(200):  # the records and keys of the tick exist
        index.add_speculative(
            request % 2, [int(str(k)) for k in prompts[request % 8]], expires_at=9.0
        )
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for request in range(20_000):
            keys = [int(str(k)) for k in prompts[request % 8]]  # new int objects
            index.add_speculative(request % 2, keys, expires_at=9.0)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 16_000  # a record per request would be ~200 bytes each: ~4 MB
    assert index.expire(9.0) == 24  # 4 prompts of 3 keys on each replica
    assert index.speculative_count(0, now=9.0) == index.speculative_count(1, now=9.0) == 0


PROXY_STREAM = st.lists(  # (seconds since the last step, TTL, replica, keys, expire after?)
    st.tuples(
        st.sampled_from([0.0, 0.25, 1.0]),
        st.sampled_from([0.5, 2.0, 3.0]),
        st.integers(0, 3),
        st.lists(st.integers(0, 6), max_size=4),
        st.booleans(),
    ),
    max_size=60,
)


@pytest.mark.parametrize("make", FAST, ids=lambda f: f.__name__)
@settings(max_examples=200, deadline=None)
@given(stream=PROXY_STREAM)
def test_speculation_recorded_as_a_proxy_records_it_expires_as_the_reference_says(
    make: Callable[[], ResidencyIndex],
    stream: list[tuple[float, float, int, list[int], bool]],
) -> None:
    """A proxy's clock only moves on, and each workload's TTL is fixed, so most records
    arrive in order of expiry and some (a shorter TTL after a longer one) do not: every
    expiry drops what the reference drops, and lookups agree at every step."""
    fast, oracle = make(), ReferenceResidencyIndex()
    now = 0.0
    for step, ttl, replica, keys, expire in stream:
        now += step
        for impl in (fast, oracle):
            impl.add_speculative(replica, keys, expires_at=now + ttl)
        if expire:
            assert fast.expire(now) == oracle.expire(now)
        for probe in ([0, 1, 2], [3, 4], [5, 6, 0]):
            assert fast.leading_runs(probe, now=now) == oracle.leading_runs(probe, now=now)
        for r in range(4):
            assert fast.speculative_count(r, now=now) == oracle.speculative_count(r, now=now)
    assert fast.expire(now + 10) == oracle.expire(now + 10)


def _apply(index: ResidencyIndex, op: str, replica: int, keys: list[int], when: int) -> None:
    if op == "add":
        index.add(replica, keys)
    elif op == "remove":
        index.remove(replica, keys)
    elif op == "spec":
        index.add_speculative(replica, keys, expires_at=float(when))
    elif op == "clear":
        index.clear_replica(replica)
    elif op == "step":
        next(index.clear_replica_steps(replica, chunk=2), None)  # left unfinished
    else:
        index.expire(float(when))


MASKS = st.dictionaries(st.integers(0, 9), st.integers(0, 63), max_size=10)


@settings(max_examples=500, deadline=None)
@given(
    keys=st.lists(st.integers(0, 9), max_size=8),
    masks=MASKS,
    with_spec=MASKS,
    hidden=st.integers(0, 63),
)
def test_a_short_prompts_runs_are_read_key_by_key_as_by_runs_of_equal_masks(
    keys: list[int], masks: dict[int, int], with_spec: dict[int, int], hidden: int
) -> None:
    """The bitmask index reads a prompt of at most eight blocks one key at a time: the
    same runs, in the same order, as its reading by runs of equal masks."""
    short = bitmask._short_runs(keys, masks, with_spec, hidden)
    grouped = bitmask._grouped_runs(keys, masks, with_spec, hidden)
    assert list(short.items()) == list(grouped.items())


FAR = 2**40  # keys built anew per prompt: equal to the index's, not the same objects
LONG_PROMPT = st.tuples(  # (how much of one shared beginning, then keys of its own)
    st.sampled_from([32, 33, 40, 48]), st.lists(st.integers(48, 60), max_size=10)
)
LOOK = st.tuples(  # a prompt looked up (and, as a proxy does, recorded for a replica)
    LONG_PROMPT, st.sampled_from([None, 5.0, 15.0]), st.integers(-1, 3)
)
CHANGE = st.one_of(
    st.tuples(  # a replica comes to hold a beginning, or loses its end
        st.sampled_from(["hold", "drop"]), st.integers(0, 4), st.integers(0, 60), st.just(0)
    ),
    st.tuples(
        st.sampled_from(["add", "remove", "spec", "clear", "expire", "step"]),
        st.integers(0, 4),
        st.lists(st.integers(0, 60), max_size=8),
        st.integers(0, 20),
    ),
)
PROXY_STEPS = st.lists(st.tuples(CHANGE, st.lists(LOOK, min_size=1, max_size=5)), max_size=25)


@settings(max_examples=300, deadline=None)
@given(steps=PROXY_STEPS)
def test_long_prompts_sharing_beginnings_are_looked_up_as_the_reference_says(
    steps: list[tuple[tuple[str, int, int | list[int], int], list[tuple[Any, ...]]]],
) -> None:
    """The bitmask index looks a long prompt up from the end of a beginning it looked up
    before (``_Prefix``): whatever changes between lookups (holders of the beginning's
    keys, speculation recorded and expired, replicas cleared), every lookup agrees with
    the reference, and finds the runs in the order a whole walk finds them."""
    fast, oracle = BitmaskResidencyIndex(), ReferenceResidencyIndex()
    for (op, replica, keys, when), looks in steps:
        for impl in (fast, oracle):
            if isinstance(keys, int):  # hold or drop
                held = [FAR + k for k in range(keys)]
                impl.add(replica, held) if op == "hold" else impl.remove(replica, held[-3:])
            else:
                _apply(impl, op, replica, [FAR + k for k in keys], when)
        for (begun, tail), now, chosen in looks:
            prompt = [FAR + k for k in [*range(begun), *tail]]
            got = fast.leading_runs(prompt, now=now)
            assert got == oracle.leading_runs(prompt, now=now)
            spec = fast._with_spec if now is not None else {}
            walked = bitmask._grouped_runs(prompt, fast._masks, spec, fast._hidden)
            assert list(got.items()) == list(walked.items())
            if chosen >= 0 and now is not None:
                for impl in (fast, oracle):
                    impl.add_speculative(chosen, prompt, expires_at=now + 2.0)


def test_a_beginning_two_lookups_share_is_remembered_until_one_of_its_keys_changes() -> None:
    index = BitmaskResidencyIndex()
    system = [FAR + k for k in range(40)]
    index.add(3, system)
    first = index.leading_runs([*system, 1, 2], now=1.0)
    second = index.leading_runs([*system, 5], now=1.0)  # shares the 40 keys
    assert first == second == {3: 40}
    remembered = index._spec_prefixes[system[0]]
    assert remembered.valid and remembered.keys == system
    assert index.leading_runs([*system, 6], now=1.0) == {3: 40}
    index.add_speculative(5, system[:10], expires_at=2.0)  # a key of it changed holders
    assert not remembered.valid
    assert index.leading_runs([*system, 7], now=1.0) == {3: 40, 5: 10}
    assert index.leading_runs([*system, 7], now=2.0) == {3: 40}  # expired


def test_a_replica_hidden_by_a_step_by_step_clear_leaves_a_remembered_beginning() -> None:
    index = BitmaskResidencyIndex()
    index.add(3, [FAR - 1, FAR - 2])  # first in the index: the first step clears them only
    system = [FAR + k for k in range(40)]
    index.add(3, system)
    index.add(4, system[:20])
    for question in (1, 2, 3):
        assert index.leading_runs([*system, question]) == {3: 40, 4: 20}
    steps = index.clear_replica_steps(3, chunk=1)
    next(steps)
    assert index.leading_runs([*system, 4]) == {4: 20}


def test_the_compact_index_grows_and_rebuilds_keeping_every_key() -> None:
    """Past its first table's load the compact index rebuilds into bigger ones (dropping
    tombstones); a clear begun before a rebuild is finished by it; keys at both ends of
    the 64-bit range and replicas past 64 (a second word of bitset) come through."""
    index, oracle = CompactResidencyIndex(), ReferenceResidencyIndex()
    rng = random.Random(5)
    batches = [[rng.getrandbits(64) for _ in range(3000)] for _ in range(6)]
    batches[0] += [0, 1, BIG, BIG - 1]
    steps = None
    for round_, batch in enumerate(batches):
        for impl in (index, oracle):
            impl.add(round_ % 3, batch)
            impl.add(70 + round_, batch[: len(batch) // 3])
            impl.remove(round_ % 3, batch[::5])
        if round_ == 2:
            index.add(9, batches[0])
            oracle.add(9, batches[0])
            steps = index.clear_replica_steps(9, chunk=100)
            next(steps)
            oracle.clear_replica(9)
    assert steps is not None and list(steps)  # the rebuild finished it: one last step
    few = [rng.getrandbits(64) for _ in range(12_000)]  # in engine-sized batches: past a rebuild
    for start in range(0, len(few), 10):
        for impl in (index, oracle):
            impl.add(4, few[start : start + 10])
            impl.remove(4, few[start : start + 3])
    assert dict(index.holdings()) == dict(oracle.holdings())
    assert index.key_count() == oracle.key_count() > 12_000
    for replica in (0, 1, 2, 4, 9, 70, 75):
        assert sorted(index.keys_of(replica)) == sorted(oracle.keys_of(replica))
        assert index.key_count(replica) == oracle.key_count(replica)
    prompt = [0, 1, BIG, BIG - 1, *batches[0][:60]]
    assert index.leading_runs(prompt) == oracle.leading_runs(prompt)
    keys, masks = index.residency()
    second_word = dict(zip(keys.tolist(), masks[:, 1].tolist(), strict=True))
    assert second_word[batches[0][0]] == 1 << (70 - 64)


def test_the_compact_index_reads_prompts_in_c_where_the_request_path_is_compiled() -> None:
    """``make native`` builds the C lookup with the compiled modules, so ``make check``
    runs the conformance suite over it (and over numpy, above)."""
    if not native.built():
        pytest.skip("a checkout run from source")
    assert "kvcore.index._probe" in native.built()
    assert CompactResidencyIndex().native is not None


@pytest.mark.parametrize(
    "make", [CompactResidencyIndex, numpy_compact, vectorised_compact], ids=lambda f: f.__name__
)
def test_the_compact_index_refuses_a_key_outside_64_bits_in_c_as_in_numpy(
    make: Callable[[], ResidencyIndex],
) -> None:
    index = make()
    index.add(0, [1, 2])
    for bad in ([1, -1], [1, 2**64], [1, "2"]):
        with pytest.raises((OverflowError, TypeError, ValueError)):
            index.leading_runs([*bad] * 40)  # (long: the array and C paths)


def test_a_change_with_a_key_outside_64_bits_is_refused_whole_in_c() -> None:
    """A proxy's index is never left half changed by a bad key: the C pass converts
    every key before it changes any."""
    index = proxy_compact()
    if index.native is None:
        pytest.skip("a checkout run from source")
    index.add(0, [1, 2])
    for bad in ([3, 4, -1], [3, 4, 2**64], [3, 4, "5"]):
        with pytest.raises((OverflowError, TypeError)):
            index.add(1, bad)
        with pytest.raises((OverflowError, TypeError)):
            index.remove(0, [1, *bad])
    assert dict(index.holdings()) == {1: 0b1, 2: 0b1}
    assert (index.key_count(), index.key_count(0), index.key_count(1)) == (2, 2, 0)


@pytest.mark.parametrize("make", [proxy_compact, stepwise_compact], ids=lambda f: f.__name__)
def test_a_batch_past_the_tables_room_is_applied_across_a_rebuild(
    make: Callable[[], ResidencyIndex],
) -> None:
    """A proxy's batch bigger than the room left before a rebuild: the C pass stops at
    the room, the table is rebuilt (tombstones dropped) and the rest applied."""
    index, oracle = make(), ReferenceResidencyIndex()
    rng = random.Random(9)
    first = [rng.getrandbits(64) for _ in range(600)]
    second = [rng.getrandbits(64) for _ in range(5000)]
    for impl in (index, oracle):
        impl.add(0, first)
        impl.remove(0, first[:500])  # tombstones
        impl.add(1, [*first[:300], *second, *second[:10]])  # (repeats count once)
    assert dict(index.holdings()) == dict(oracle.holdings())
    assert [index.key_count(r) for r in (None, 0, 1)] == [oracle.key_count(r) for r in (None, 0, 1)]
    assert index.leading_runs(second) == oracle.leading_runs(second) == {1: 5000}


@pytest.mark.parametrize(
    "make", [proxy_compact, stepwise_compact, numpy_compact], ids=lambda f: f.__name__
)
def test_keys_coming_and_going_at_a_steady_count_stay_exact_through_slot_reuse_and_rebuilds(
    make: Callable[[], ResidencyIndex],
) -> None:
    """Replicas evicting as many keys as they store (an engine at a full cache), a word of
    bitset past 64 too: new keys take removed keys' slots (in C) and the table is rebuilt
    from time to time (in C in steps, reads and changes meeting both tables meanwhile),
    and every key, count and run stays the reference's, along the way too."""
    index, oracle = make(), ReferenceResidencyIndex()
    rng = random.Random(11)
    held = {replica: [rng.getrandbits(64) for _ in range(400)] for replica in (0, 3, 70)}
    for impl in (index, oracle):
        for replica, keys in held.items():
            impl.add(replica, keys)
    for _ in range(300):
        replica = rng.choice(list(held))
        stored = [rng.getrandbits(64) for _ in range(rng.randrange(1, 60))]
        evicted, held[replica] = held[replica][: len(stored)], held[replica][len(stored) :]
        held[replica] += stored
        for impl in (index, oracle):
            impl.add(replica, stored)
            impl.remove(replica, evicted)
        assert index.leading_runs(held[replica]) == oracle.leading_runs(held[replica])
        assert index.leading_runs(evicted) == oracle.leading_runs(evicted)
    assert dict(index.holdings()) == dict(oracle.holdings())
    assert [index.key_count(r) for r in (None, 0, 3, 70)] == [
        oracle.key_count(r) for r in (None, 0, 3, 70)
    ]
    for keys in held.values():
        assert index.leading_runs(keys) == oracle.leading_runs(keys)
