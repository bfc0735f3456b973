"""An in-process OTLP trace receiver for the tracing tests: OpenTelemetry's own collector service
(``opentelemetry.proto.collector.trace.v1.TraceService``) on a loopback port, on a thread pool of
its own, keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.StatusCode


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    status_code: int
    status_message: str
    service_name: str


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        spans = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                spans.extend(_received(span, service) for span in scope_spans.spans)
        self.receiver.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _received(span, service: str) -> ReceivedSpan:
    return ReceivedSpan(
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        kind=span.kind,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes=_attributes(span.attributes),
        status_code=span.status.code,
        status_message=span.status.message,
        service_name=service,
    )


class OtlpReceiver:
    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [span for span in self.spans() if span.trace_id == trace_id]

    def wait_for(self, condition, timeout: float = 15.0, what: str = "spans"):
        """Poll until ``condition(spans)`` is truthy; returns its value. AssertionError with the
        spans seen after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            result = condition(spans)
            if result:
                return result
            if time.monotonic() > deadline:
                names = [(s.name, s.attributes.get("gen_ai.request.id")) for s in spans]
                raise AssertionError(f"timed out waiting for {what}; received {names}")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.stop(None)


def spans_of_request(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.attributes.get("gen_ai.request.id") == request_id]


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [span.name for span in spans]
    return named
