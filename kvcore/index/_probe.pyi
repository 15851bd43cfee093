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
) -> dict[int, int]: ...
