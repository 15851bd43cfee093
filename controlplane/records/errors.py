"""The records half's exceptions, translated to HTTP statuses at the admin API's edge.

RecordsError
 ├── NotFound              no such workload, model, token, revision or replica   404
 ├── PreconditionFailed    If-Match names a version that is no longer current   412
 ├── Conflict              changed concurrently, already exists, or in use       409
 ├── InvalidInput          a field's value is refused (``field`` names it)       422
 └── Unavailable           etcd or the database does not answer                  503
"""

from __future__ import annotations


class RecordsError(Exception):
    """Base of every error the records half raises on purpose."""

    status = 500


class NotFound(RecordsError):
    status = 404


class PreconditionFailed(RecordsError):
    status = 412


class Conflict(RecordsError):
    status = 409


class InvalidInput(RecordsError):
    """``field`` is a dotted path in the request (``body.locality_weight``)."""

    status = 422

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Unavailable(RecordsError):
    status = 503
