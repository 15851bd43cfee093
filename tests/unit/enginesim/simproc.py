"""Run a real ``kvroute-sim`` process for tests, and talk to it (HTTP, SUB, replay).

``SimProcess`` starts the console script on free loopback ports (port 0 everywhere) and
waits for its ready line, bounded by a deadline; it never sleeps for a fixed time.
Other components' end-to-end tests can use it the same way.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import zmq

SIM = Path(sys.executable).parent / "kvroute-sim"
READY = "kvroute-sim ready"
END_SEQ = b"\xff" * 8


class SimProcess:
    """A ``kvroute-sim`` process; subclasses run other kvroute servers the same way."""

    ready_prefix = READY
    default_args: tuple[str, ...] = (
        str(SIM),
        "--port=0",
        "--kv-events-endpoint=tcp://127.0.0.1:0",
        "--replay-endpoint=tcp://127.0.0.1:0",
    )

    def __init__(
        self, *args: str, start_timeout: float = 20.0, env: dict[str, str] | None = None
    ) -> None:
        self.args = [*self.default_args, *args]
        self.extra_env = dict(env or {})  # KVROUTE_* settings given as the environment
        self.start_timeout = start_timeout
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in __exit__
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = self.events = self.replay = ""

    def __enter__(self) -> SimProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        env |= self.extra_env
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self.stderr, env=env)
        try:
            line = self._ready_line()
        except RuntimeError:
            self.__exit__(None, None, None)
            raise
        self.on_ready(dict(part.split("=", 1) for part in line.split()[2:]))
        return self

    def on_ready(self, fields: dict[str, str]) -> None:
        """Read the addresses the ready line names."""
        self.url, self.events, self.replay = fields["http"], fields["events"], fields["replay"]

    def _ready_line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if sel.select(left):
                    line = self.proc.stdout.readline().decode()
                    if line.startswith(self.ready_prefix):
                        return line.strip()
                    if not line:
                        break
        code = self.proc.wait(timeout=self.start_timeout)
        name = Path(self.args[0]).name
        raise RuntimeError(f"{name} did not start (exit {code}): {self.stderr_text()}")

    def stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.stderr_tail = self.stderr_text()
        self.stderr.close()

    # -- HTTP ----------------------------------------------------------------------------

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ):
        """``(status, parsed JSON or text)`` of one request."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"content-type": "application/json", **(headers or {})}
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, _parse(resp.read(), resp.headers.get_content_type())
        except urllib.error.HTTPError as err:
            return err.code, _parse(err.read(), err.headers.get_content_type())

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
        status, answer = self.call("POST", path, body, headers=headers)
        assert status == 200, answer
        return answer

    def stream(self, path: str, body: Any, headers: dict[str, str] | None = None) -> list[Any]:
        """The parsed ``data:`` events of an SSE response (``[DONE]`` kept as a string)."""
        headers = {"content-type": "application/json", **(headers or {})}
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            text = resp.read().decode()
        events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
        return [e if e == "[DONE]" else json.loads(e) for e in events]

    def metric(self, name: str) -> float:
        _, text = self.call("GET", "/metrics")
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def _parse(body: bytes, content_type: str) -> Any:
    if content_type == "application/json":
        return json.loads(body)
    return body.decode()


class EventClient:
    """A SUB socket on the engine's events and a DEALER on its replay socket."""

    def __init__(self, sim: SimProcess) -> None:
        self.sim = sim
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(sim.events)
        self.live: dict[int, bytes] = {}

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> EventClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect_live(self, attempts: int = 100) -> None:
        """Wait until live batches arrive: send tiny requests until one is seen."""
        for i in range(attempts):
            self.sim.post("/v1/completions", {"prompt": [7, i, *range(40)], "max_tokens": 1})
            if self.sub.poll(100):
                self.receive_available()
                return
        raise AssertionError("no live KV events reached the subscriber")

    def receive_available(self, timeout_ms: int = 0) -> None:
        while self.sub.poll(timeout_ms):
            _topic, seq, payload = self.sub.recv_multipart()
            self.live[int.from_bytes(seq, "big")] = payload
            timeout_ms = 0

    def receive_until(self, seq: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while seq not in self.live:
            left = deadline - time.monotonic()
            assert left > 0, f"seq {seq} never arrived live"
            if self.sub.poll(int(left * 1000)):
                self.receive_available()

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(self.sim.replay)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            batches = []
            while True:
                empty, _topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    return batches
                batches.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)


def cached_tokens(usage: dict[str, Any]) -> int:
    """A usage's cached tokens as vLLM reports them (with --enable-prompt-tokens-details):
    its details are null (absent from a stream's usage chunk) when nothing was cached."""
    details = usage.get("prompt_tokens_details")
    return 0 if details is None else int(details["cached_tokens"])
