"""The residency index: block key -> replicas holding it (see :mod:`kvcore.index.base`).

- :class:`BitmaskResidencyIndex`: ``dict[key, int bitmask]``, the fastest lookups;
- :class:`CompactResidencyIndex`: a numpy hash table, ~4x smaller;
- :class:`ReferenceResidencyIndex`: plain sets, the oracle in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvcore.index.base import MAX_REPLICA_ORDINAL, ResidencyIndex
from kvcore.index.bitmask import BitmaskResidencyIndex
from kvcore.index.compact import CompactResidencyIndex
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

__all__ = [
    "INDEXES",
    "MAX_REPLICA_ORDINAL",
    "READ_ALWAYS_INDEXES",
    "BitmaskResidencyIndex",
    "CompactResidencyIndex",
    "ReferenceResidencyIndex",
    "ResidencyIndex",
]
