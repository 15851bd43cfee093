"""The proxy's transport: its own HTTP/1.1 server and client, CORS, and its workers' metrics.

Everything here moves bytes; nothing here routes. The app sees the server only as
``Request``/``Response`` and a handler (:mod:`dataplane.transport.interface`), and the
upstream code sees the client only as a pool that sends a request and reads its response
piece by piece. Both are this package's own, chosen by measurement over uvicorn and
aiohttp (docs/architecture.md, "Proxy stack"); tests/unit/dataplane/transport/ runs one
conformance suite against them and against adapters over uvicorn and aiohttp, so a
maintainer can swap either and see what breaks.
"""
