"""The residency index: block key -> replicas holding it (see :mod:`kvcore.index.base`).

- :class:`BitmaskResidencyIndex`: production; ``dict[key, int bitmask]``;
- :class:`ReferenceResidencyIndex`: plain sets, the oracle in tests.
"""

from __future__ import annotations

from kvcore.index.base import MAX_REPLICA_ORDINAL, ResidencyIndex
from kvcore.index.bitmask import BitmaskResidencyIndex
from kvcore.index.reference import ReferenceResidencyIndex

__all__ = [
    "MAX_REPLICA_ORDINAL",
    "BitmaskResidencyIndex",
    "ReferenceResidencyIndex",
    "ResidencyIndex",
]
