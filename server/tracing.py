"""Tracing of the gRPC server (``--otlp-traces-endpoint``, ``--collect-detailed-traces``).

Each call to a v1 service gets a SERVER span, a child of the W3C ``traceparent`` (and
``tracestate``) in the call's metadata when there is one. A generation call's span gets one
``llm_request`` child per sample, built when the sample finishes from the times the engine
core recorded for it (``engine/timings.py``), with ``queue``, ``prefill``, ``decode`` and
``detokenize`` children. Every span carries the request id (``gen_ai.request.id``); the
attribute names are vLLM's where vLLM has one (``gen_ai.*``), ours (``llmrpc.*``) otherwise.

OpenTelemetry is imported only when tracing is on: ``TracingConfig`` is plain, the interceptor
is installed only then, and the servicer's hooks (``traced_call``) cost a context-variable read
when it is off.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

import grpc

from llmrpc.common import tracing as otlp
from llmrpc.server.logs import current_request_id
from llmrpc.server.tracing_config import TracingConfig

logger = logging.getLogger(__name__)

# The traced call running in this task (set by the interceptor; None: not traced).
_call_var: contextvars.ContextVar[TracedCall | None] = contextvars.ContextVar(
    "llmrpc_traced_call", default=None
)


def traced_call() -> TracedCall | None:
    """The current call's tracing, when tracing is on and the call's span is sampled."""
    return _call_var.get()


class ServerTracing:
    """The server's tracer and its interceptor; ``shutdown`` exports what is left."""

    def __init__(self, config: TracingConfig) -> None:
        from opentelemetry.trace import SpanKind

        self.config = config
        self.provider = otlp.acquire(config.otlp_traces_endpoint)
        self.tracer = self.provider.get_tracer("llmrpc.server")
        self.server_kind = SpanKind.SERVER
        self._released = False

    def interceptor(self, services) -> grpc.aio.ServerInterceptor:
        return TracingInterceptor(self, services)

    async def shutdown(self) -> None:
        if not self._released:
            self._released = True
            await asyncio.to_thread(otlp.release, self.config.otlp_traces_endpoint)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span around each call to ``services``; placed after the request-id
    interceptor, so the request id is known when the span starts."""

    def __init__(self, tracing: ServerTracing, services) -> None:
        self._tracing = tracing
        self._services = frozenset(services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        service, _, name = method.lstrip("/").partition("/")
        if handler is None or service not in self._services:
            return handler
        kind = next(k for k in _HANDLER_KINDS if getattr(handler, k) is not None)
        behavior = getattr(handler, kind)
        return handler._replace(**{kind: self._traced(behavior, service, name)})

    def _traced(self, behavior, service: str, method: str):
        tracing = self._tracing

        async def traced(request, context):
            metadata = context.invocation_metadata() or ()
            carrier = {key: value for key, value in metadata if key in otlp.TRACE_HEADERS}
            attributes = {
                "rpc.system": "grpc",
                "rpc.service": service,
                "rpc.method": method,
                "gen_ai.request.id": current_request_id() or "",
            }
            with tracing.tracer.start_as_current_span(
                f"{service}/{method}",
                context=otlp.trace_context(carrier),
                kind=tracing.server_kind,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                if span.is_recording():
                    _call_var.set(TracedCall(tracing, span, attributes["gen_ai.request.id"]))
                try:
                    response = await behavior(request, context)
                except BaseException as error:
                    _end_with_error(span, error, context)
                    raise
                span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])
                return response

        return traced


_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _end_with_error(span, error: BaseException, context) -> None:
    from opentelemetry.trace import Status, StatusCode

    code = _status_code(context, error)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    details = _status_details(context) or f"{type(error).__name__}: {error}"
    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))


def _status_code(context, error: BaseException) -> grpc.StatusCode:
    """The status the call ends with: set by ``abort`` (on the network or the in-process
    channel), CANCELLED when its task was cancelled, else UNKNOWN (what grpc.aio answers)."""
    status = getattr(context, "status", None)  # the in-process channel's context
    if status is not None:
        return status.code
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _status_details(context) -> str:
    status = getattr(context, "status", None)
    if status is not None:
        return status.details
    details = context.details() if hasattr(context, "details") else None
    return details.decode() if isinstance(details, bytes) else details or ""


class TracedCall:
    """One traced generation call: what its engine spans need."""

    def __init__(self, tracing: ServerTracing, span, request_id: str) -> None:
        self.tracing = tracing
        self.span = span
        self.request_id = request_id
        self.request_attributes: dict[str, Any] = {}

    def ask_timings(self, params, model: str) -> None:
        """Have the engine time this request (``engine/timings.py``)."""
        params.collect_timings = True
        self.request_attributes = {
            "gen_ai.response.model": model,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n,
        }
        if params.max_tokens is not None:
            self.request_attributes["gen_ai.request.max_tokens"] = params.max_tokens

    def engine_spans(self, output) -> None:
        """The spans of one finished sample (``output.timings`` set), built once the call's task
        next waits: the response need not wait for them (they take a millisecond or so)."""
        asyncio.get_running_loop().call_soon(self._build_engine_spans, output)

    def _build_engine_spans(self, output) -> None:
        try:
            from llmrpc.server.tracing_spans import engine_spans

            engine_spans(self, output)
        except Exception:  # noqa: BLE001 - tracing never fails or stops a request
            logger.exception("building the engine spans of %s failed", self.request_id)
