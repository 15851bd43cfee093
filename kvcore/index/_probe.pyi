"""Types of the C module kvcore/index/_probe.c (see its comment)."""

from collections.abc import Sequence

from kvcore.index.base import U64

def leading_runs(
    keys: Sequence[int],
    table_keys: U64,
    table_masks: U64,
    bits: int,
    multiplier: int,
    words: int,
    zero: U64,
    spec: dict[int, int] | None,
    hidden: U64 | None,
    old_keys: U64 | None,
    old_masks: U64 | None,
    old_bits: int,
    moved: int,
) -> dict[int, int]: ...
def change(
    keys: Sequence[int],
    table_keys: U64,
    table_masks: U64,
    bits: int,
    multiplier: int,
    words: int,
    replica: int,
    added: bool,
    room: int,
    start: int,
    old_keys: U64 | None,
    old_masks: U64 | None,
    old_bits: int,
    moved: int,
) -> tuple[int, int, int, int, bool, int]: ...
def rebuild(
    table_keys: U64,
    table_masks: U64,
    bits: int,
    multiplier: int,
    words: int,
    new_keys: U64,
    new_masks: U64,
    new_bits: int,
    start: int,
    stop: int,
    room: int,
) -> int: ...
