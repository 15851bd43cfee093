"""Key mapper: published router keys equal what a proxy computes for the same prompt."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.engine_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvcore.keys import block_keys, root_key
from sidecar.key_mapper import KeyMapper, RouterCleared, RouterRemoved, RouterStored

MODEL = "m"


def held_keys(mapper: KeyMapper, medium: str = "GPU") -> set[int]:
    return {key for m, key, _ in mapper.held() if m == medium}


def store_prompt(
    mapper: KeyMapper,
    tokens: list[int],
    engine_bs: int,
    *,
    splits: list[int] | None = None,
    salt: str = "",
    base: int = 0,
    group: int = 0,
) -> list[int]:
    """Store ``tokens`` as an engine would: engine blocks, hashed by prefix, in runs."""
    n_full = len(tokens) // engine_bs
    hashes = [base + hash(tuple(tokens[: (i + 1) * engine_bs])) % (1 << 62) for i in range(n_full)]
    cuts = [0, *(splits or []), n_full]
    for lo, hi in itertools.pairwise(cuts):
        if lo == hi:
            continue
        parent = hashes[lo - 1] if lo else None
        run = BlockStored(
            tuple(hashes[lo:hi]),
            parent,
            tuple(tokens[lo * engine_bs : hi * engine_bs]),
            engine_bs,
            group=group,
            namespace=salt if lo == 0 else "",
        )
        mapper.apply(run)
    return hashes


def test_same_block_size_publishes_the_proxys_keys_with_parents() -> None:
    mapper = KeyMapper(MODEL, 16)
    tokens = list(range(100, 164))
    first = BlockStored((1, 2), None, tuple(tokens[:32]), 16)
    second = BlockStored((3, 4), 2, tuple(tokens[32:]), 16)
    expected = block_keys(tokens, model=MODEL)
    assert mapper.apply(first) == [RouterStored(tuple(expected[:2]), None)]
    assert mapper.apply(second) == [RouterStored(tuple(expected[2:]), expected[1])]


def test_cache_salt_and_lora_select_the_key_root() -> None:
    mapper = KeyMapper(MODEL, 16)
    tokens = tuple(range(32))
    (stored,) = mapper.apply(BlockStored((1, 2), None, tokens, 16, lora_name="a", namespace="t"))
    assert isinstance(stored, RouterStored)
    assert list(stored.keys) == block_keys(list(tokens), model=MODEL, lora_name="a", namespace="t")


@pytest.mark.parametrize(
    ("engine_bs", "router_bs"), [(1, 16), (4, 16), (32, 16), (16, 32), (12, 16)]
)
def test_engine_blocks_are_grouped_into_router_blocks(engine_bs: int, router_bs: int) -> None:
    rng = random.Random(engine_bs * 100 + router_bs)
    tokens = [rng.randrange(50_000) for _ in range(200)]
    mapper = KeyMapper(MODEL, router_bs)
    n_blocks = len(tokens) // engine_bs
    store_prompt(mapper, tokens, engine_bs, splits=sorted(rng.sample(range(1, n_blocks), 5)))
    covered = tokens[: n_blocks * engine_bs]
    assert held_keys(mapper) == set(block_keys(covered, model=MODEL, block_size=router_bs))


def test_sglang_partial_last_page_carries_its_tokens_to_the_child() -> None:
    mapper = KeyMapper(MODEL, 4)
    tokens = tuple(range(10))
    mapper.apply(BlockStored((1, 2), None, tokens[:3], 2))  # pages [0,1] and [2]
    mapper.apply(BlockStored((3, 4, 5), 2, tokens[3:], 3))  # continues after the short page
    assert held_keys(mapper) == set(block_keys(list(tokens), model=MODEL, block_size=4))


def test_removing_the_engine_block_that_completed_a_router_block_removes_its_key() -> None:
    mapper = KeyMapper(MODEL, 4)
    tokens = list(range(8))
    hashes = store_prompt(mapper, tokens, 1)
    keys = block_keys(tokens, model=MODEL, block_size=4)
    assert mapper.apply(BlockRemoved((hashes[7],))) == [RouterRemoved((keys[1],))]
    assert mapper.apply(BlockRemoved((hashes[6], hashes[5], hashes[4]))) == []
    assert mapper.apply(BlockRemoved((hashes[3],))) == [RouterRemoved((keys[0],))]
    assert mapper.engine_blocks == 3 and mapper.router_keys == 0


def test_a_key_held_by_two_engine_blocks_leaves_with_the_last() -> None:
    mapper = KeyMapper(MODEL, 16)
    tokens = list(range(16))
    key = block_keys(tokens, model=MODEL)[0]
    assert mapper.apply(BlockStored((1,), None, tuple(tokens), 16, group=0))
    assert mapper.apply(BlockStored((1,), None, tuple(tokens), 16, group=1)) == []
    assert mapper.apply(BlockRemoved((1,), group=0)) == []
    assert mapper.apply(BlockRemoved((1,), group=1)) == [RouterRemoved((key,))]


def test_a_re_reported_block_is_not_counted_twice() -> None:
    mapper = KeyMapper(MODEL, 16)
    event = BlockStored((1,), None, tuple(range(16)), 16)
    mapper.apply(event)
    assert mapper.apply(event) == []
    assert mapper.apply(BlockRemoved((1,))) != []


def test_media_are_separate() -> None:
    mapper = KeyMapper(MODEL, 16)
    mapper.apply(BlockStored((1,), None, tuple(range(16)), 16))
    mapper.apply(BlockStored((1,), None, tuple(range(16)), 16, medium=MEDIUM_CPU))
    mapper.apply(BlockRemoved((1,)))
    assert held_keys(mapper, MEDIUM_CPU) == set(block_keys(list(range(16)), model=MODEL))
    assert held_keys(mapper) == set()


def test_unknown_parent_is_counted_and_nothing_is_keyed() -> None:
    mapper = KeyMapper(MODEL, 16)
    assert mapper.apply(BlockStored((5,), 999, tuple(range(16)), 16)) == []
    assert mapper.stats.unknown_parents == 1
    assert mapper.router_keys == 0 and mapper.engine_blocks == 0


def test_unknown_removal_is_counted() -> None:
    mapper = KeyMapper(MODEL, 16)
    assert mapper.apply(BlockRemoved((5,))) == []
    assert mapper.stats.unknown_removals == 1


def test_cleared_forgets_everything() -> None:
    mapper = KeyMapper(MODEL, 16)
    store_prompt(mapper, list(range(64)), 16)
    assert mapper.apply(AllBlocksCleared()) == [RouterCleared()]
    assert mapper.router_keys == 0 and mapper.engine_blocks == 0
    assert mapper.apply(BlockStored((9,), 1234, tuple(range(16)), 16)) == []


def test_held_lists_parents_before_children() -> None:
    mapper = KeyMapper(MODEL, 16)
    store_prompt(mapper, list(range(48)), 16, splits=[1, 2])
    keys = block_keys(list(range(48)), model=MODEL)
    assert list(mapper.held()) == [
        ("GPU", keys[0], None),
        ("GPU", keys[1], keys[0]),
        ("GPU", keys[2], keys[1]),
    ]
    assert root_key(model=MODEL) not in held_keys(mapper)


prompts = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=40), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    prompts=prompts,
    engine_bs=st.sampled_from([1, 2, 4, 8]),
    router_bs=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 1000),
)
def test_held_keys_are_the_union_of_the_prompts_keys(
    prompts: list[list[int]], engine_bs: int, router_bs: int, seed: int
) -> None:
    """Prompts sharing prefixes, stored in random runs: held == union of their keys."""
    rng = random.Random(seed)
    mapper = KeyMapper(MODEL, router_bs)
    expected: set[int] = set()
    for tokens in prompts:
        n = len(tokens) // engine_bs
        splits = sorted(rng.sample(range(1, n), min(2, n - 1))) if n > 1 else []
        store_prompt(mapper, tokens, engine_bs, splits=splits)
        full = tokens[: n * engine_bs]
        expected |= set(block_keys(full, model=MODEL, block_size=router_bs))
    assert held_keys(mapper) == expected


def test_newly_held_keys_are_published_as_unbroken_runs_with_their_parents() -> None:
    mapper = KeyMapper(MODEL, 16)
    tokens = tuple(range(48))
    k0, k1, k2 = block_keys(list(tokens), model=MODEL)
    mapper.apply(BlockStored((1, 2), None, tokens[:32], 16, group=1))
    mapper.apply(BlockRemoved((1,), group=1))  # k0 leaves, k1 stays held by group 1
    stored = mapper.apply(BlockStored((1, 2, 3), None, tokens, 16, group=0))
    assert stored == [RouterStored((k0,), None), RouterStored((k2,), k1)]


def test_a_long_single_token_page_run_is_keyed_in_one_pass() -> None:
    mapper = KeyMapper(MODEL, 16)
    tokens = tuple(range(20_000))
    hashes = tuple(range(1, 20_001))
    (stored,) = mapper.apply(BlockStored(hashes, None, tokens, 1))
    assert isinstance(stored, RouterStored)
    assert list(stored.keys) == block_keys(list(tokens), model=MODEL)
    assert mapper.engine_blocks == 20_000 and mapper.router_keys == 1250


def test_data_parallel_ranks_keep_their_own_chains_and_share_keys() -> None:
    mapper = KeyMapper(MODEL, 16)
    shared, only_rank1 = tuple(range(32)), tuple(range(100, 116))
    keys = block_keys(list(shared), model=MODEL)
    mapper.apply(BlockStored((1, 2), None, shared, 16), rank=0)
    assert mapper.apply(BlockStored((1, 2), None, shared, 16), rank=1) == []
    (stored,) = mapper.apply(BlockStored((9,), None, only_rank1, 16), rank=1)
    assert mapper.apply(BlockStored((5,), 2, tuple(range(32, 48)), 16), rank=1) != []
    removed = mapper.clear_rank(1)  # rank 1 restarted; rank 0 still holds `shared`
    assert removed == [RouterRemoved((*stored.keys, *block_keys(list(range(48)), model=MODEL)[2:]))]  # type: ignore[union-attr]
    assert held_keys(mapper) == set(keys)
    assert mapper.apply(AllBlocksCleared(), rank=0) == [RouterCleared()]


def test_evicting_any_contributor_of_a_router_block_releases_its_key() -> None:
    """Engine 16, router 32: router key 1 spans engine blocks 2 and 3; the engine serves
    only 32 tokens once block 2 goes, so key 1 must go with it, whichever block leaves."""
    mapper = KeyMapper(MODEL, 32)
    tokens = list(range(64))
    k0, k1 = block_keys(tokens, model=MODEL, block_size=32)
    mapper.apply(BlockStored((1, 2, 3, 4), None, tuple(tokens), 16))
    assert held_keys(mapper) == {k0, k1}
    assert mapper.apply(BlockRemoved((3,))) == [RouterRemoved((k1,))]
    assert mapper.apply(BlockRemoved((1,))) == [RouterRemoved((k0,))]
    assert held_keys(mapper) == set()
    assert mapper.apply(BlockRemoved((4,))) == [] and mapper.apply(BlockRemoved((2,))) == []


def test_sglang_single_token_pages_release_a_key_when_any_page_of_it_goes() -> None:
    mapper = KeyMapper(MODEL, 4)
    tokens = list(range(8))
    hashes = store_prompt(mapper, tokens, 1)
    k0, k1 = block_keys(tokens, model=MODEL, block_size=4)
    assert mapper.apply(BlockRemoved((hashes[5],))) == [RouterRemoved((k1,))]
    assert mapper.apply(BlockRemoved((hashes[0],))) == [RouterRemoved((k0,))]
    assert mapper.router_keys == 0


def test_a_re_stored_contributor_brings_back_the_key_it_completes_again() -> None:
    """Out of order: block 2 leaves (key 1 goes), then is computed and stored again while
    block 3 stayed cached: key 1 is backed again and held again."""
    mapper = KeyMapper(MODEL, 32)
    tokens = list(range(64))
    k0, k1 = block_keys(tokens, model=MODEL, block_size=32)
    mapper.apply(BlockStored((1, 2, 3, 4), None, tuple(tokens), 16))
    mapper.apply(BlockRemoved((3,)))
    assert mapper.apply(BlockStored((3,), 2, tuple(tokens[32:48]), 16)) == [RouterStored((k1,), k0)]
    assert held_keys(mapper) == {k0, k1}


def assert_parents_first(mapper: KeyMapper) -> None:
    seen: set[tuple[str, int]] = set()
    held = {(medium, key) for medium, key, _ in mapper.held()}
    for medium, key, parent in mapper.held():
        if parent is not None and (medium, parent) in held:
            assert (medium, parent) in seen, f"{key} listed before its parent {parent}"
        seen.add((medium, key))


def test_held_lists_parents_first_after_a_parent_is_removed_and_stored_again() -> None:
    mapper = KeyMapper(MODEL, 16)
    tokens = list(range(48))
    store_prompt(mapper, tokens, 16)
    hashes = store_prompt(KeyMapper(MODEL, 16), tokens, 16)
    mapper.apply(BlockRemoved((hashes[0],)))
    mapper.apply(BlockStored((hashes[0],), None, tuple(tokens[:16]), 16))
    assert len(list(mapper.held())) == 3
    assert_parents_first(mapper)


def test_opaque_blocks_and_their_children_hold_no_key() -> None:
    """Two prompts whose image placeholders are the same tokens but whose images differ:
    router keys cannot tell them apart, so blocks from the image on are not keyed."""
    mapper = KeyMapper(MODEL, 16)
    tokens = tuple(range(64))
    text_key = block_keys(list(tokens[:16]), model=MODEL)[0]
    image_a = BlockStored((1, 2, 3), None, tokens[:48], 16, opaque_from=1)
    image_b = BlockStored((1, 7, 8), None, tokens[:48], 16, opaque_from=1)
    assert mapper.apply(image_a) == [RouterStored((text_key,), None)]
    assert mapper.apply(image_b) == []
    assert mapper.apply(BlockStored((4,), 3, tokens[48:], 16)) == []  # chained after
    assert held_keys(mapper) == {text_key}


def test_a_key_needs_only_the_blocks_of_its_own_router_block() -> None:
    """SGLang pages that do not line up with router blocks: the page that completes key 0
    also starts key 1. Evicting a page of key 0 must not keep key 1 from being held."""
    mapper = KeyMapper(MODEL, 32)
    tokens = tuple(range(68))
    k0, k1 = block_keys(list(tokens), model=MODEL, block_size=32)
    mapper.apply(BlockStored((1, 2), None, tokens[:20], 16))  # pages [0:16] and [16:20]
    mapper.apply(BlockStored((3, 4), 2, tokens[20:52], 16))  # [20:36] completes key 0
    assert mapper.apply(BlockRemoved((1,))) == [RouterRemoved((k0,))]
    assert mapper.apply(BlockStored((5,), 4, tokens[52:68], 16)) == [RouterStored((k1,), k0)]
