"""A server's event loop: uvloop where it is installed (kvroute depends on it everywhere
but Windows), asyncio's own otherwise.

uvloop gives a shorter, steadier path through each server's sockets: the proxy's
requests, the sidecar's ZMQ-to-NATS events, the control plane's ingest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a new loop (uvloop's where available)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(main)
    return uvloop.run(main)
