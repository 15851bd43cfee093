"""OpenTelemetry spans of routed requests, with the routing decision as attributes.

With ``--tracing`` each chat or completion request is one server span
``kvroute.proxy.request``, a child of the client's W3C ``traceparent`` when it sent one;
the engine receives this span's ``traceparent``, so the engine's work nests under the
routing decision. Without ``--tracing`` nothing is created and the client's
``traceparent`` is forwarded untouched. Spans go to the exporter the service is given
(the console, as JSON, by default: point a collector at it or pass another exporter).

Attributes: ``kvroute.request_id``, ``kvroute.workload``, ``kvroute.strategy``,
``kvroute.model``, ``kvroute.replica``, ``kvroute.attempts``,
``kvroute.prefix_blocks.matched``, ``kvroute.prefix_blocks.total``,
``kvroute.cached_tokens.predicted``, ``kvroute.cached_tokens.measured``,
``kvroute.outcome``, ``http.response.status_code``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()


class Tracing:
    """Spans for one worker; ``exporter`` None: the console (stderr)."""

    def __init__(self, exporter: SpanExporter | None = None) -> None:
        self.provider = TracerProvider()
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter or ConsoleSpanExporter(out=sys.stderr))
        )
        self._tracer = self.provider.get_tracer("kvroute.proxy")

    @contextmanager
    def request(self, headers: Mapping[str, str], request_id: str) -> Iterator[Span]:
        """The span of one request, child of the client's ``traceparent`` if any."""
        parent = _propagator.extract(carrier=dict(headers))
        with self._tracer.start_as_current_span(
            "kvroute.proxy.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"kvroute.request_id": request_id},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield span

    def shutdown(self) -> None:
        self.provider.shutdown()


def traceparent_of(span: Span) -> str | None:
    """The W3C ``traceparent`` header value that makes the engine's work a child."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    del span  # the current span is the one injected
    return carrier.get("traceparent")


def describe(span: Span, attributes: Mapping[str, Any], *, failed: bool) -> None:
    """Set the decision's attributes and the span's status at the end of the request."""
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if failed:
        span.set_status(Status(StatusCode.ERROR))
