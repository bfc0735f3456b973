"""The engine's spans of one finished sample, built after the fact from its ``RequestTimings``.

``llm_request`` (arrival in the engine core to the last output) carries vLLM's ``gen_ai.*``
attributes; its children are the phases:

- ``queue``: arrival to the start of the first step that computed some of the request (or to
  its end, if it never ran);
- ``prefill``: that step's start to the end of the step that sampled the first token (prompt
  chunks, prefix-cache hits and the first token);
- ``decode``: first token to last token (absent for a single token);
- ``detokenize``: the engine detokenizes each token as it is sampled, between decode steps;
  the span starts at the first token and lasts the request's summed detokenization time.

Only in a module of its own so that OpenTelemetry is imported when a traced call finishes.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from llmrpc.common.tracing import seconds_to_ns


def engine_spans(call, output) -> None:
    """``call``: the ``TracedCall``; ``output``: a finished ``RequestOutput`` with timings."""
    timings = output.timings
    end = timings.finished or timings.last_token or timings.arrival
    attributes = {
        "gen_ai.request.id": call.request_id,
        **call.request_attributes,
        **_usage(output),
        **_latencies(timings, end),
        **_detailed(call.tracing.config, timings),
    }
    if attributes.get("gen_ai.request.n", 1) > 1:
        attributes["llmrpc.sample.index"] = output.index
    tracer = call.tracing.tracer
    parent = trace.set_span_in_context(call.span)
    request_span = tracer.start_span(
        "llm_request",
        context=parent,
        kind=SpanKind.INTERNAL,
        attributes=attributes,
        start_time=seconds_to_ns(timings.arrival),
    )
    if output.error:
        request_span.set_status(Status(StatusCode.ERROR, output.error))
    inside = trace.set_span_in_context(request_span)
    for name, start, stop in _phases(timings, end):
        span = tracer.start_span(
            name,
            context=inside,
            attributes={"gen_ai.request.id": call.request_id},
            start_time=seconds_to_ns(start),
        )
        span.end(end_time=seconds_to_ns(stop))
    request_span.end(end_time=seconds_to_ns(end))


def _phases(timings, end: float) -> list[tuple[str, float, float]]:
    scheduled, first, last = timings.first_scheduled, timings.first_token, timings.last_token
    phases = [("queue", timings.arrival, scheduled or end)]
    if scheduled and first:
        phases.append(("prefill", scheduled, first))
    if first and last > first:
        phases.append(("decode", first, last))
    if first and timings.detokenize_s:
        phases.append(("detokenize", first, first + timings.detokenize_s))
    return phases


def _usage(output) -> dict:
    reason = output.finish_reason.value if output.finish_reason is not None else "unknown"
    return {
        "gen_ai.usage.prompt_tokens": output.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": output.num_output_tokens,
        "llmrpc.usage.cached_tokens": output.num_cached_tokens,
        "gen_ai.response.finish_reasons": (reason,),
    }


def _latencies(timings, end: float) -> dict:
    """vLLM's latency attributes, in seconds, measured in the engine core."""
    scheduled, first, last = timings.first_scheduled, timings.first_token, timings.last_token
    values = {
        "gen_ai.latency.e2e": end - timings.arrival,
        "gen_ai.latency.time_in_queue": (scheduled or end) - timings.arrival,
        "llmrpc.engine.num_steps": timings.num_steps,
        "llmrpc.latency.time_in_detokenize": timings.detokenize_s,
    }
    if first:
        values["gen_ai.latency.time_to_first_token"] = first - timings.arrival
        values["gen_ai.latency.time_in_model_prefill"] = first - scheduled
        values["gen_ai.latency.time_in_model_decode"] = last - first
        values["gen_ai.latency.time_in_model_inference"] = last - scheduled
    return values


def _detailed(config, timings) -> dict:
    """``--collect-detailed-traces``: the summed step times (shared with the batch)."""
    values = {}
    if config.model_forward:
        values["gen_ai.latency.time_in_model_forward"] = timings.model_forward_s
    if config.model_execute:
        values["gen_ai.latency.time_in_model_execute"] = timings.model_execute_s
    return values
