"""Fixtures shared by the integration tests (the real-server fixtures are in tests/conftest.py)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from kvroute.servers import NatsServer
from tests.integration.sidecar_harness import Watcher


@pytest.fixture
async def watcher(nats_server: NatsServer) -> AsyncIterator[Watcher]:
    """A control plane's view of one replica's subjects, on a replica id of its own."""
    w = Watcher(nats_server.url, replica=f"r{random.randrange(1 << 30)}")
    await w.start()
    yield w
    await w.stop()
