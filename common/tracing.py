"""OpenTelemetry trace export (``--otlp-traces-endpoint``), shared by the gRPC server and the
REST gateway of one process.

Nothing of OpenTelemetry is imported until a tracer provider is asked for, so a server started
without the flag pays nothing for it. One provider per endpoint and process, counted: the
server and the gateway ``llmrpc serve`` runs beside it share it, and the last of them to stop
flushes it, so the spans of the calls that finished while draining are exported before exit.

The exporter follows vLLM: OTLP over gRPC by default, OTLP over HTTP (protobuf) when
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``. The SDK's other ``OTEL_*`` variables
apply (sampler, batch schedule, headers, service name).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
SERVICE_NAME = "llmrpc"  # unless OTEL_SERVICE_NAME names another
# W3C trace context: the headers (HTTP) and metadata keys (gRPC) a trace travels in.
TRACE_HEADERS = ("traceparent", "tracestate")
FLUSH_TIMEOUT_MS = 5000  # at shutdown: the longest wait for a collector that does not answer


def check_endpoint(flag: str, endpoint: str | None) -> None:
    """ValueError naming ``flag`` for an endpoint the exporter could not use as meant."""
    if endpoint is None:
        return
    parsed = urlparse(endpoint)
    # Without a scheme the gRPC exporter would dial with TLS; say so rather than guess.
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(
            f"{flag} must be an http:// or https:// URL (e.g. http://localhost:4317; https "
            f"dials with TLS), got {endpoint!r}"
        )
    protocol = exporter_protocol()
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"{flag}: {PROTOCOL_ENV}={protocol!r} is not supported; use one of "
            f"{', '.join(PROTOCOLS)}"
        )


def exporter_protocol() -> str:
    return os.environ.get(PROTOCOL_ENV, "grpc").strip()


class _Shared:
    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.users = 0


_lock = threading.Lock()
_providers: dict[str, _Shared] = {}


def acquire(endpoint: str) -> Any:
    """The process's ``TracerProvider`` exporting to ``endpoint`` (made on first use); each
    ``acquire`` is matched by one ``release``."""
    with _lock:
        shared = _providers.get(endpoint)
        if shared is None:
            shared = _providers[endpoint] = _Shared(_new_provider(endpoint))
            logger.info("exporting traces to %s (OTLP, %s)", endpoint, exporter_protocol())
        shared.users += 1
        return shared.provider


def release(endpoint: str) -> None:
    """Blocking (call it off the event loop): the last user's release exports the spans still
    buffered, waiting at most ``FLUSH_TIMEOUT_MS``, and stops the exporter."""
    with _lock:
        shared = _providers.get(endpoint)
        if shared is None:
            return
        shared.users -= 1
        if shared.users > 0:
            return
        del _providers[endpoint]
    if not shared.provider.force_flush(FLUSH_TIMEOUT_MS):
        logger.warning("traces not all exported to %s before shutdown", endpoint)
    shared.provider.shutdown()


def _new_provider(endpoint: str) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    return provider


def _exporter(endpoint: str) -> Any:
    if exporter_protocol() == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint)


def trace_context(headers) -> Any:
    """The OpenTelemetry context a request's W3C ``traceparent``/``tracestate`` name (an empty
    one without them): ``headers`` is a mapping of lower-case names to values."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def trace_headers(span) -> tuple[tuple[str, str], ...]:
    """``span``'s context as W3C trace headers, for the calls made on its behalf."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return tuple(carrier.items())


def seconds_to_ns(seconds: float) -> int:
    return int(seconds * 1e9)
