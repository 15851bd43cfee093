"""No request body gets a 500 from the proxy's request path as it runs, compiled
(dataplane/native.py) or not: the whole path in process, a proxy of a fleet whose
``kv_aware`` routing tokenizes and keys every prompt it can, in front of in-memory
replicas; many more bodies than the end-to-end fuzz test
(tests/e2e/test_proxy_static.py) sends to real processes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.proxy_path import MODEL, PROMPTS, MemoryTransport, _MemoryReplicas, _service
from dataplane.transport.server import HttpServer
from tests.request_bodies import request_bodies

PATHS = ["/v1/chat/completions", "/v1/completions", "/generate"]


async def _answers(requests: list[tuple[str, dict[str, Any]]]) -> list[bytes]:
    service = _service("kv_aware", debug_headers=True)
    service.upstream.pool = _MemoryReplicas(PROMPTS["hello"][1], None)
    server = HttpServer(service.app, max_body_bytes=service.settings.max_body_bytes)
    answers = []
    try:
        for path, body in requests:
            answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

            def on_write(data: bytes, answer: asyncio.Future[bytes] = answer) -> None:
                if not answer.done():
                    answer.set_result(data)

            client = server.protocol()
            client.connection_made(MemoryTransport(on_write))  # type: ignore[arg-type]
            raw = json.dumps(body).encode()
            client.data_received(
                b"POST %s HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (path.encode(), len(raw), raw)
            )
            answers.append(await asyncio.wait_for(answer, 5))
            client.connection_lost(None)
    finally:
        service.reporter = None  # no control plane to deliver its last report to
        await service.aclose()
    return answers


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(PATHS), request_bodies(MODEL)), min_size=1, max_size=25))
def test_no_body_gets_a_500_from_a_kv_aware_proxy(requests: list[tuple[str, Any]]) -> None:
    for (path, body), answer in zip(requests, asyncio.run(_answers(requests)), strict=True):
        status = int(answer.split(b" ", 2)[1])
        assert status != 500, (path, body, answer)
        if status >= 400:  # refused in OpenAI's shape, saying what is wrong
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
