"""Fixtures shared by the whole suite.

Integration tests ask for ``nats_server``, ``etcd_server`` or ``postgres_server``: each
starts the real server on a free loopback port, once per test session, and stops it at
the end. Unit tests ask for none of them and need nothing running.

The suite runs the proxy's request path compiled when ``make native`` built it (``make
test`` does) and refuses to start on compiled modules built before a source changed:
Python would import them instead of the new source (``dataplane/native.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dataplane import native
from kvroute.servers import EtcdServer, NatsServer, PostgresServer


def pytest_sessionstart(session: pytest.Session) -> None:
    old = native.stale()
    if old:
        pytest.exit(
            f"compiled modules built before a source of dataplane or kvcore changed (or no "
            f"longer listed): {', '.join(old)}; run `make native`, or `make clean-native` to "
            f"test from source",
            returncode=2,
        )


def pytest_report_header() -> str:
    return f"dataplane request path compiled (mypyc): {len(native.built())}/{len(native.MODULES)}"


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
