"""What a client is told when the proxy cannot serve its request: OpenAI's error shape.

Every refusal the proxy makes is an :class:`ApiError` carrying an HTTP status and the
fields of OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, so
the official clients raise their usual exception classes. The ASGI edge turns them into
responses; nothing below it builds an error body by hand::

    DataplaneError (dataplane.errors)
    └── ApiError                    status + OpenAI error fields
        ├── BadRequest              400 invalid_request_error
        ├── Unauthorized            401 authentication_error
        ├── NotFound                404 not_found_error (an unknown model, a route)
        ├── MethodNotAllowed        405
        ├── RequestTimeout          408 (the request's head came too slowly)
        ├── PayloadTooLarge         413
        ├── HeadersTooLarge         431 (the request line and headers)
        ├── StreamBroken            502: the replica broke off a stream already started
                                    (sent as a last SSE error event: the status is out)
        └── ServiceUnavailable      503
            └── NoReplica           503 with Retry-After: no replica can take the request
"""

from __future__ import annotations

from typing import Any

import msgspec

from dataplane.errors import DataplaneError


class ApiError(DataplaneError):
    """A refusal in OpenAI's shape; ``headers`` are added to the response."""

    status = 500
    error_type = "internal_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body())


class BadRequest(ApiError):
    status, error_type = 400, "invalid_request_error"


class Unauthorized(ApiError):
    status, error_type = 401, "authentication_error"


class NotFound(ApiError):
    status, error_type = 404, "not_found_error"


class MethodNotAllowed(ApiError):
    status, error_type = 405, "invalid_request_error"


class RequestTimeout(ApiError):
    status, error_type = 408, "invalid_request_error"


class PayloadTooLarge(ApiError):
    status, error_type = 413, "invalid_request_error"


class HeadersTooLarge(ApiError):
    status, error_type = 431, "invalid_request_error"


class StreamBroken(ApiError):
    status, error_type = 502, "upstream_error"


class ServiceUnavailable(ApiError):
    status, error_type = 503, "service_unavailable"


class NoReplica(ServiceUnavailable):
    """No replica can take the request: ``Retry-After`` says when to try again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(
            message,
            code="no_replica",
            headers=((b"retry-after", str(retry_after_s).encode()),),
        )
