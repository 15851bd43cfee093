"""Cross-origin calls from browser pages (``--cors-allowed-origins``), as vLLM and SGLang
answer them with Starlette's ``CORSMiddleware``.

Off by default: a proxy with no allowed origin adds nothing and answers a preflight like
any other request (405 on the inference routes). With origins allowed (``*`` for any):

- an ``OPTIONS`` preflight (``Origin`` and ``Access-Control-Request-Method``) is answered
  by the proxy itself, before authentication and routing: 200 allowing any method and the
  headers the page asked for, or 400 in OpenAI's error shape for an origin not allowed;
- every other answer to an allowed ``Origin`` carries ``Access-Control-Allow-Origin`` and
  exposes ``x-request-id`` and the ``x-kvroute-*`` headers to the page's script.

The replicas' own ``Access-Control-*`` headers are never relayed (``upstream.py``), so the
proxy's policy is the one a browser sees, whatever the engines allow.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from dataplane.http_errors import BadRequest

ANY = "*"
PREFLIGHT_METHODS = b"DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"  # Starlette's, for "*"
PREFLIGHT_MAX_AGE = b"600"
CORS_ANSWER_HEADERS = (
    b"x-request-id, x-kvroute-replica, x-kvroute-workload, x-kvroute-prefix-blocks, "
    b"x-kvroute-decision"
)  # what a page's script may read of an answer


def check_origin(origin: str) -> str:
    """An allowed origin as a browser sends it (``scheme://host[:port]``), or ``*``."""
    if origin == ANY:
        return origin
    origin = origin.removesuffix("/")  # as pasted from an address bar
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{origin!r} is not an origin (scheme://host[:port]) or *")
    if parts.path or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{origin!r} is not an origin: no path, query or user in one")
    try:
        _ = parts.port
    except ValueError:
        raise ValueError(
            f"{origin!r} is not an origin: its port is not a number to 65535"
        ) from None
    return origin.lower()


class Cors:
    """The allowed origins and the headers that answer them."""

    __slots__ = ("_any", "_origins")

    def __init__(self, origins: Iterable[str]) -> None:
        allowed = [check_origin(origin) for origin in origins]
        self._any = ANY in allowed
        self._origins = frozenset(allowed)

    def allows(self, origin: str) -> bool:
        return self._any or origin.lower() in self._origins

    def answer_headers(self, headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
        """Headers added to any answer to a request from an allowed origin (none for a
        request that names no origin or one not allowed)."""
        origin = headers.get("origin")
        if origin is None or not self.allows(origin):
            return []
        return [
            *self._allow_origin(origin),
            (b"access-control-expose-headers", CORS_ANSWER_HEADERS),
        ]

    @staticmethod
    def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
        return (
            method == "OPTIONS"
            and "origin" in headers
            and ("access-control-request-method" in headers)
        )

    def preflight(self, headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
        """What allows a preflight, over and above :meth:`answer_headers`;
        :class:`BadRequest` when its origin is not allowed."""
        origin = headers["origin"]
        if not self.allows(origin):
            raise BadRequest(f"Cross-origin requests from {origin} are not allowed.", "origin")
        answer = [
            (b"access-control-allow-methods", PREFLIGHT_METHODS),
            (b"access-control-max-age", PREFLIGHT_MAX_AGE),
        ]
        asked = headers.get("access-control-request-headers")
        if asked:
            answer.append((b"access-control-allow-headers", asked.encode("latin-1")))
        return answer

    def _allow_origin(self, origin: str) -> list[tuple[bytes, bytes]]:
        if self._any:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"origin")]
