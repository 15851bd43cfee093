"""A whole kvroute fleet for end-to-end tests, as ``kvroute up`` runs it.

``kvroute up``'s :class:`~kvroute.up.LocalFleet` starts NATS, etcd, the control plane (on
SQLite), a sidecar beside each engine and ``kvroute-proxy``; the engines are
``kvroute-sim`` processes the test starts itself (``--engines``), so a test can slow one
down, load it or kill it. LocalFleet is asyncio code whose supervisor keeps reading every
child's output: it runs on an event loop in a thread of its own, so tests stay plain
functions and may block (the synchronous ``openai`` client) without stalling a child.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from kvroute.servers import free_port
from kvroute.supervisor import Child
from kvroute.up import Fleet, LocalFleet, UpOptions
from tests.e2e.proxyproc import http_request
from tests.unit.enginesim.simproc import SimProcess

T = TypeVar("T")
START_TIMEOUT_S = 180.0  # a bound on a failure: every child is waited for until ready


def wait_for(check: Callable[[], bool], what: str, deadline_s: float = 30.0) -> None:
    """Poll ``check`` (each call a real request) until it holds, bounded."""
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class FullStack:
    """``with FullStack(engines, run_dir, env):`` the fleet in front of ``engines`` (their
    ``engine_kind``: ``vllm`` or ``sglang``, as ``kvroute up --engine-kind`` takes it).

    ``env`` is given to every child the fleet starts (``KVROUTE_<FLAG>`` settings)."""

    def __init__(
        self,
        engines: list[SimProcess],
        run_dir: Path,
        env: dict[str, str],
        engine_kind: str = "vllm",
        pd: tuple[int, int] | None = None,
    ) -> None:
        """``pd``: the first P engines are prefill replicas, the next D decode ones."""
        self.engines = engines
        self.options = UpOptions(
            engines=tuple(sim.url for sim in engines),
            port=free_port(),
            data_dir=run_dir,
            engine_kind=engine_kind,
            pd=pd,
        )
        self.env = env
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fullstack")
        self.local: LocalFleet | None = None
        self.fleet = Fleet(run_dir=run_dir, admin_token="")

    def _run(self, work: Coroutine[Any, Any, T], timeout_s: float = START_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)

    def __enter__(self) -> FullStack:
        self._thread.start()
        saved = {name: os.environ.get(name) for name in self.env}
        os.environ.update(self.env)  # the children inherit it; restored once all started
        try:
            self.fleet = self._run(self._start())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return self

    async def _start(self) -> Fleet:
        self.local = LocalFleet(self.options, say=lambda _line: None)
        return await self.local.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.local is not None:
            self._run(self.local.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()

    # -- talking to it -------------------------------------------------------------------

    @property
    def proxy_url(self) -> str:
        return self.fleet.proxy_urls[0]

    def request(
        self, path: str, body: Any = None, *, method: str = "POST", **headers: str
    ) -> tuple[int, dict[str, str], bytes]:
        """One request to the proxy: ``(status, headers in lower case, body)``."""
        status, got, answer = http_request(
            self.proxy_url + path, body, method=method, headers=headers
        )
        return status, {k.lower(): v for k, v in got.items()}, answer

    def readyz(self) -> dict[str, Any]:
        return dict(json.loads(self.request("/readyz", method="GET")[2]))

    def wait_proxy_caught_up(self) -> None:
        """Wait until the proxy routes on all the control plane shows now: its ``/readyz``
        state at the epoch and at least the version ``/v1/replicas`` names (the proxy
        applies each change one delta, <= 50 ms, later; more on a loaded machine)."""
        status, body = self.admin("GET", "/v1/replicas")
        assert status == 200
        wanted = body["state"]

        def caught_up() -> bool:
            held = self.readyz()["state"]
            return bool(held["epoch"] == wanted["epoch"] and held["version"] >= wanted["version"])

        wait_for(caught_up, f"the proxy to hold the control plane's state {wanted}")

    def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One admin API call with the fleet's admin token: ``(status, JSON)``."""
        bearer = {"authorization": f"Bearer {self.fleet.admin_token}"}
        status, _, answer = http_request(
            self.fleet.admin_urls[0] + path, body, method=method, headers=bearer
        )
        return status, json.loads(answer)

    # -- the control plane ---------------------------------------------------------------

    def _controlplane(self) -> Child:
        assert self.local is not None
        return [c for c in self.local.supervisor.children if c.name == "controlplane-0"][-1]

    def kill_controlplane(self) -> None:
        """SIGKILL, as a crash would: no goodbye to proxies or NATS."""
        child = self._controlplane()
        child.stopping = True  # expected: not a failure of the fleet
        os.killpg(child.proc.pid, signal.SIGKILL)
        self._run(child.proc.wait(), 30)

    def restart_controlplane(self) -> None:
        """Start the control plane again with its data and gRPC address (the proxy's
        ``--controlplane``); return once it is ready."""
        assert self.local is not None
        spec = self._controlplane().spec
        grpc_port = self.fleet.grpc_addresses[0].rsplit(":", 1)[1]
        argv = list(spec.argv)
        argv[argv.index("--grpc-port") + 1] = grpc_port
        child = self._run(self.local.supervisor.start(dataclasses.replace(spec, argv=argv)))
        admin = re.search(r"\badmin=(\S+)", child.ready_text)
        assert admin is not None, child.ready_text
        self.fleet.admin_urls[0] = admin.group(1)
