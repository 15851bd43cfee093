"""Entry point of ``kvroute-sim``: a simulated vLLM/SGLang engine.

Builds everything from typed settings (``settings.py``), binds the HTTP socket, the ZMQ
PUB and the ROUTER (port 0 anywhere picks a free port), then prints one line that
launchers and tests wait for::

    kvroute-sim ready http=http://127.0.0.1:8100 events=tcp://127.0.0.1:5557 replay=tcp://127.0.0.1:5558

(``http=https://...`` when it serves HTTPS: ``--ssl-keyfile`` and ``--ssl-certfile``, as
vLLM's) and serves until SIGINT/SIGTERM. Exit status 2 means the settings, the tokenizer or an
address was refused, with the reason on stderr.
"""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Sequence

import uvicorn
import zmq

from enginesim.engine import Engine
from enginesim.errors import SettingsError, StartupError
from enginesim.http import SimApp
from enginesim.settings import SimSettings, parse_settings
from enginesim.tokens import PromptTokenizer
from kvcore.tokenize import TokenizerError
from kvruntime.loop import run
from kvruntime.sockets import bind_tcp, url_of

READY_PREFIX = "kvroute-sim ready"


class _Server(uvicorn.Server):
    """uvicorn's server, announcing readiness once it accepts connections."""

    def __init__(self, config: uvicorn.Config, ready_line: str) -> None:
        super().__init__(config)
        self.ready_line = ready_line

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        print(self.ready_line, flush=True)


def bind_http(host: str, port: int) -> socket.socket:
    try:
        sock = bind_tcp(host, port)
    except OSError as exc:
        raise StartupError(f"cannot bind HTTP to {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(settings: SimSettings) -> None:
    try:
        tokenizer = PromptTokenizer(settings.tokenizer)
    except TokenizerError as exc:
        raise StartupError(f"tokenizer {settings.tokenizer!r}: {exc}") from exc
    engine = Engine(settings, tokenizer.filler_ids)
    sock = bind_http(settings.host, settings.port)
    try:
        await engine.start()
    except zmq.ZMQError as exc:
        sock.close()
        raise StartupError(f"cannot bind the KV event sockets: {exc}") from exc
    tls = settings.ssl_certfile is not None
    http = url_of(sock, "https" if tls else "http")
    engine.transfers.host, engine.transfers.port = sock.getsockname()[:2]
    ready = (
        f"{READY_PREFIX} http={http} events={engine.publisher.endpoint} "
        f"replay={engine.publisher.replay_endpoint or 'off'} format={settings.event_format}"
    )
    config = uvicorn.Config(
        SimApp(settings, engine, tokenizer),
        lifespan="off",
        http="httptools",
        loop="none",
        access_log=False,
        log_level=settings.log_level,
        timeout_keep_alive=30,
        backlog=2048,
        proxy_headers=False,
        ssl_keyfile=str(settings.ssl_keyfile) if tls else None,
        ssl_certfile=str(settings.ssl_certfile) if tls else None,
    )  # uvicorn's ``date`` and ``server`` headers on, as the engines' servers send them
    try:
        await _Server(config, ready).serve(sockets=[sock])
    finally:
        await engine.aclose()
        sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
    except SettingsError as exc:
        print(f"kvroute-sim: invalid settings: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(levelname)s %(name)s %(message)s"
    )
    try:
        run(serve(settings))
    except StartupError as exc:
        print(f"kvroute-sim: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":  # ``python -m enginesim.main``, as the ``kvroute-sim`` script
    sys.exit(main())
