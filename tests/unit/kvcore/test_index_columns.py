"""Residency as columns: every index gives and loads them alike, and the wire form
refuses buffers that do not hold what their header says."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from kvcore.index import (
    BitmaskResidencyIndex,
    CompactResidencyIndex,
    ReferenceResidencyIndex,
    ResidencyIndex,
)
from kvcore.index.columns import (
    BadColumns,
    MostShared,
    from_columns,
    restricted,
    to_columns,
)
from kvcore.pb import routing_pb2

IMPLEMENTATIONS: list[Callable[[], ResidencyIndex]] = [
    BitmaskResidencyIndex,
    CompactResidencyIndex,
    ReferenceResidencyIndex,
]
BIG = 2**64 - 1


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda f: f.__name__)
def index(request: pytest.FixtureRequest) -> ResidencyIndex:
    return request.param()  # type: ignore[no-any-return]


def _filled(index: ResidencyIndex) -> ResidencyIndex:
    rng = random.Random(2)
    keys = [0, 1, BIG, *(rng.getrandbits(64) for _ in range(3000))]
    index.add(0, keys)
    index.add(5, keys[::3])
    index.add(70, keys[1:200])  # a second word of bitset
    index.remove(0, keys[10:20])
    index.add_speculative(9, keys[:50], expires_at=5.0)  # not residency: left out
    return index


@pytest.mark.parametrize("source", IMPLEMENTATIONS, ids=lambda f: f.__name__)
def test_columns_carry_one_index_into_another_key_for_key(
    index: ResidencyIndex, source: Callable[[], ResidencyIndex]
) -> None:
    original = _filled(source())
    keys, masks = original.residency()
    assert keys.dtype == masks.dtype == np.uint64 and masks.shape == (keys.size, 2)
    index.add_rows(keys, masks)
    assert dict(index.holdings()) == dict(original.holdings())
    for replica in (0, 5, 9, 70):
        assert index.key_count(replica) == original.key_count(replica)
    assert index.key_count() == original.key_count() == 3003  # those 0 lost, 70 holds
    assert index.leading_runs([0, 1, BIG]) == original.leading_runs([0, 1, BIG])


def _rows(pieces: list[tuple[np.ndarray, np.ndarray]]) -> dict[int, tuple[int, ...]]:
    rows: dict[int, tuple[int, ...]] = {}
    for keys, masks in pieces:
        for key, row in zip(keys.tolist(), masks.tolist(), strict=True):
            assert key not in rows  # each key once
            rows[key] = tuple(row) + (0,) * (2 - len(row))
    return rows


def test_residency_in_pieces_is_the_residency(index: ResidencyIndex) -> None:
    _filled(index)
    keys, masks = index.residency()
    assert _rows(list(index.residency_chunks(rows=500))) == _rows([(keys, masks)])


def test_residency_in_pieces_gives_each_key_once_while_the_index_grows(
    index: ResidencyIndex,
) -> None:
    _filled(index)
    before = dict(index.holdings())
    pieces = []
    for number, piece in enumerate(index.residency_chunks(rows=256)):
        pieces.append(piece)
        if number == 2:  # (the compact table is rebuilt, larger)
            index.add(3, range(10**6, 10**6 + 20_000))
    rows = _rows(pieces)
    assert set(before) <= set(rows) | set(range(10**6, 10**6 + 20_000))
    assert all(key in before or key >= 10**6 for key in rows)


@pytest.mark.parametrize("top", [0, 1, 7, 40])
def test_the_most_shared_keys_ranked_piece_by_piece_are_those_ranked_at_once(top: int) -> None:
    rng = np.random.default_rng(top)
    keys = rng.integers(1, 2**63, 5_000, dtype=np.uint64)
    masks = rng.integers(0, 2**64, (5_000, 2), dtype=np.uint64)
    masks &= rng.integers(0, 2**64, (5_000, 2), dtype=np.uint64)  # holder counts vary
    masks[rng.random((5_000, 2)) < 0.8] = 0  # many held by one or no replica...
    masks[::50, 0] = 0b111  # ...and ties
    ranking = MostShared(top)
    for start in range(0, 5_000, 333):
        ranking.add(keys[start : start + 333], masks[start : start + 333])
    counts = np.bitwise_count(masks).sum(axis=1)
    order = [i for i in np.argsort(-counts, kind="stable").tolist() if counts[i] > 1][:top]
    expected = [(int(keys[i]), int(masks[i, 0]) | int(masks[i, 1]) << 64) for i in order]
    assert ranking.result() == expected


def test_rows_add_to_what_an_index_holds(index: ResidencyIndex) -> None:
    index.add(1, [10, 11])
    masks = np.array([[0b1000], [0b1010]], dtype=np.uint64)
    index.add_rows(np.array([11, 12], dtype=np.uint64), masks)
    assert dict(index.holdings()) == {10: 0b10, 11: 0b1010, 12: 0b1010}
    assert (index.key_count(1), index.key_count(3)) == (3, 2)


def test_a_snapshot_for_some_replicas_holds_only_their_bits() -> None:
    index = _filled(CompactResidencyIndex())
    keys, masks = restricted(*index.residency(), [5])
    assert sorted(keys.tolist()) == sorted(index.keys_of(5))
    assert set(masks[:, 0].tolist()) == {1 << 5} and not masks[:, 1].any()


def test_columns_round_trip_through_the_wire_form() -> None:
    keys, masks = _filled(CompactResidencyIndex()).residency()
    message = routing_pb2.ResidencyColumns()
    to_columns(message, keys, masks)
    decoded = routing_pb2.ResidencyColumns.FromString(message.SerializeToString())
    got_keys, got_masks = from_columns(decoded)
    assert (got_keys == keys).all() and (got_masks == masks).all()


@pytest.mark.parametrize(
    ("count", "words", "keys", "masks"),
    [
        (3, 1, 16, 24),  # a key outside the keys buffer
        (2, 1, 16, 24),  # bitsets longer than the header says
        (2, 2, 16, 16),  # a key's second word missing
        (2, 0, 16, 0),  # no words
        (1, 65, 8, 8 * 65),  # more words than ordinals exist
    ],
)
def test_columns_whose_buffers_do_not_match_their_header_are_refused(
    count: int, words: int, keys: int, masks: int
) -> None:
    message = routing_pb2.ResidencyColumns(
        count=count, words=words, keys=b"\1" * keys, masks=b"\2" * masks
    )
    with pytest.raises(BadColumns):
        from_columns(message)


def test_reserving_room_changes_nothing_an_index_holds(index: ResidencyIndex) -> None:
    index.add(3, [1, 2])
    index.reserve(50_000)
    index.add_rows(np.arange(2, 50_002, dtype=np.uint64), np.full((50_000, 1), 1, np.uint64))
    assert index.key_count() == 50_001 and index.replicas_of(2) == {0, 3}


def test_a_compact_index_sized_for_a_snapshot_loads_it_without_a_rebuild() -> None:
    index = CompactResidencyIndex()
    index.reserve(100_000)
    table = index._table
    for start in range(1, 100_001, 8192):
        keys = np.arange(start, min(start + 8192, 100_001), dtype=np.uint64)
        index.add_rows(keys, np.full((keys.size, 1), 0b10, np.uint64))
    assert index._table is table and table.capacity == 2**18  # 100,000 at most 70% full
    assert index.key_count(1) == 100_000
