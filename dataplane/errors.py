"""The data plane's exception hierarchy, translated at its edges (HTTP errors, logs).

::

    DataplaneError
    └── StateError                 the routing state could not take an update
        └── SnapshotNeeded         a version gap, an epoch change or a broken snapshot:
                                   the state client must ask for a new snapshot
"""

from __future__ import annotations


class DataplaneError(Exception):
    """Base of every error the data plane raises on purpose."""


class StateError(DataplaneError):
    """The local routing state could not apply an update."""


class SnapshotNeeded(StateError):
    """The update stream is no longer continuous; only a full snapshot can repair it."""
