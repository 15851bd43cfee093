"""The residency index: block key -> replicas holding it (see :mod:`kvcore.index.base`).

- :class:`BitmaskResidencyIndex`: ``dict[key, int bitmask]``, the fastest lookups;
- :class:`CompactResidencyIndex`: a numpy hash table, ~4x smaller;
- :class:`ReferenceResidencyIndex`: plain sets, the oracle in tests.
"""

from __future__ import annotations

from kvcore.index.base import MAX_REPLICA_ORDINAL, ResidencyIndex
from kvcore.index.bitmask import BitmaskResidencyIndex
from kvcore.index.compact import CompactResidencyIndex
from kvcore.index.reference import ReferenceResidencyIndex

__all__ = [
    "MAX_REPLICA_ORDINAL",
    "BitmaskResidencyIndex",
    "CompactResidencyIndex",
    "ReferenceResidencyIndex",
    "ResidencyIndex",
]
