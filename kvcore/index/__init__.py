"""The residency index: block key -> replicas holding it (see :mod:`kvcore.index.base`).

- :class:`BitmaskResidencyIndex`: ``dict[key, int bitmask]``, the fastest lookups of
  prompts looked up before, without a compiler;
- :class:`CompactResidencyIndex`: a numpy hash table, ~4x smaller; with its lookup in C
  (:mod:`kvcore.index._probe`, built by ``make native`` and in the images) as fast on
  ordinary prompts and several times faster on long prompts never seen before;
- :class:`ReferenceResidencyIndex`: plain sets, the oracle in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvcore.index.base import MAX_REPLICA_ORDINAL, ResidencyIndex
from kvcore.index.bitmask import BitmaskResidencyIndex
from kvcore.index.compact import NATIVE_RUNS, CompactResidencyIndex
from kvcore.index.reference import ReferenceResidencyIndex

# the indexes a service may be configured with, by name
INDEXES: dict[str, Callable[[], ResidencyIndex]] = {
    "bitmask": BitmaskResidencyIndex,
    "compact": CompactResidencyIndex,
}
# the same for an owner that reads its index on every request (a proxy): nothing held back
READ_ALWAYS_INDEXES: dict[str, Callable[[], ResidencyIndex]] = {
    "bitmask": BitmaskResidencyIndex,
    "compact": partial(CompactResidencyIndex, hold_changes=False),
}

# compact's prompt lookup runs in C (else numpy, slower than a dict on short prompts)
NATIVE_LOOKUP = NATIVE_RUNS is not None


def read_always_index(name: str) -> Callable[[], ResidencyIndex]:
    """The index of ``READ_ALWAYS_INDEXES`` called ``name``; ``auto``: compact where its
    lookup is built in C, else bitmask."""
    if name == "auto":
        name = "compact" if NATIVE_LOOKUP else "bitmask"
    return READ_ALWAYS_INDEXES[name]


__all__ = [
    "INDEXES",
    "MAX_REPLICA_ORDINAL",
    "NATIVE_LOOKUP",
    "READ_ALWAYS_INDEXES",
    "BitmaskResidencyIndex",
    "CompactResidencyIndex",
    "ReferenceResidencyIndex",
    "ResidencyIndex",
    "read_always_index",
]
