"""Tracing of the REST gateway (``--otlp-traces-endpoint``).

Each REST request (but the probes': health, version, metrics) gets an HTTP SERVER span, a child
of its W3C ``traceparent``/``tracestate`` headers when it has them, named by its route and
carrying its request id (``gen_ai.request.id``: the caller's ``X-Request-Id``, else a new one
the request then carries on to its gRPC calls). The gRPC calls made for the request carry the
span's trace context in their metadata (``clients.connection.carrying_trace``), so the server's
spans (``server/tracing.py``) join the same trace, over the network or the in-process channel of
``llmrpc serve``.
"""

from __future__ import annotations

import asyncio
import uuid

from llmrpc.clients.connection import carrying_trace
from llmrpc.common import tracing as otlp
from llmrpc.gateway.middleware import OPEN_PATHS
from llmrpc.gateway.state import REQUEST_ID_HEADER

_WANTED = {name.encode() for name in (*otlp.TRACE_HEADERS, REQUEST_ID_HEADER)}


class GatewayTracing:
    """The gateway's tracer while the app runs (``start`` and ``stop`` in its lifespan)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.tracer = None  # None: not started, requests pass untraced

    def start(self) -> None:
        self.tracer = otlp.acquire(self.endpoint).get_tracer("llmrpc.gateway")

    async def stop(self) -> None:
        """Export what is buffered (when the server beside it has stopped too)."""
        if self.tracer is not None:
            self.tracer = None
            await asyncio.to_thread(otlp.release, self.endpoint)


class TracingMiddleware:
    """Pure ASGI, so a streamed response's span ends with its last byte."""

    def __init__(self, app, tracing: GatewayTracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope, receive, send) -> None:
        tracer = self.tracing.tracer
        if tracer is None or scope["type"] != "http" or _path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        from opentelemetry.trace import SpanKind

        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _WANTED
        }
        request_id = headers.get(REQUEST_ID_HEADER)
        if not request_id:  # the id the routes would make, made here so the span has it
            request_id = uuid.uuid4().hex
            added = (REQUEST_ID_HEADER.encode(), request_id.encode())
            scope = {**scope, "headers": [*scope["headers"], added]}
        with tracer.start_as_current_span(
            f"{scope['method']} {_path(scope)}",
            context=otlp.trace_context(headers),
            kind=SpanKind.SERVER,
            attributes=_request_attributes(scope, request_id),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            await self._serve(span, scope, receive, send)

    async def _serve(self, span, scope, receive, send) -> None:
        async def send_traced(message) -> None:
            if message["type"] == "http.response.start":
                _set_response_status(span, message["status"])
            await send(message)

        try:
            with carrying_trace(otlp.trace_headers(span)):
                await self.app(scope, receive, send_traced)
        except BaseException as error:
            _set_error(span, f"{type(error).__name__}: {error}")
            raise
        finally:
            route = scope.get("route")  # set by the router once it matched one
            if route is not None and hasattr(route, "path"):
                span.update_name(f"{scope['method']} {route.path}")
                span.set_attribute("http.route", route.path)


def _path(scope) -> str:
    root = scope.get("root_path", "")
    path = scope["path"]
    return path[len(root) :] if root and path.startswith(root) else path


def _request_attributes(scope, request_id: str) -> dict:
    return {
        "http.request.method": scope["method"],
        "url.path": _path(scope),
        "url.scheme": scope.get("scheme", "http"),
        "gen_ai.request.id": request_id,
    }


def _set_response_status(span, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:  # as OpenTelemetry's HTTP conventions: 4xx are the caller's
        _set_error(span, f"HTTP {status}")


def _set_error(span, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))
