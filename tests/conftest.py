"""Fixtures shared by the whole suite.

Integration tests ask for ``nats_server``, ``etcd_server`` or ``postgres_server``: each
starts the real server on a free loopback port, once per test session, and stops it at
the end. Unit tests ask for none of them and need nothing running.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvroute.servers import EtcdServer, NatsServer, PostgresServer


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server
