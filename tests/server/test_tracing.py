"""--otlp-traces-endpoint and --collect-detailed-traces: the spans of gRPC calls and of the engine,
received by an in-process OTLP collector from a real server (its engine core on a thread, for a
quick start; the timings' way across the process boundary is checked on its own)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import msgspec
import pytest
import pytest_asyncio
from otlp_receiver import SPAN_KIND_SERVER, STATUS_ERROR, OtlpReceiver, by_name, spans_of_request
from server_utils import frontend_config, tiny_engine_config

from llmrpc.common.args import OneLineErrorParser
from llmrpc.engine import messages
from llmrpc.engine.core_types import EngineStats
from llmrpc.engine.request import RequestOutput
from llmrpc.engine.timings import RequestTimings
from llmrpc.server import options
from llmrpc.server.app import RunningServer, start_server
from llmrpc.server.tracing_config import TracingConfig
from llmrpc.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
GENERATE = "llmrpc.v1.GenerationService/Generate"
ENGINE_PHASES = ("queue", "prefill", "decode", "detokenize")


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    started = OtlpReceiver()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def quick_export() -> Iterator[None]:
    """Batches exported every 50 ms (the SDK reads this when the server's provider is made)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(
    tiny_llama_dir: Path, receiver: OtlpReceiver, quick_export
) -> AsyncIterator[RunningServer]:
    tracing = TracingConfig(receiver.endpoint, ("all",))
    frontend = frontend_config("thread", tracing=tracing)
    running = await start_server(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    yield running
    await running.stop(grace=0)


def request(max_tokens: int = 6, **fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text="The quick brown fox",
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )


def traceparent(trace_id: str = CLIENT_TRACE_ID, span_id: str = CLIENT_SPAN_ID) -> tuple:
    return ("traceparent", f"00-{trace_id}-{span_id}-01")


async def request_spans(receiver: OtlpReceiver, request_id: str, count: int) -> dict:
    """The spans carrying ``request_id``, by name, once all ``count`` have arrived. Waited for on
    a thread: the server shares this event loop, and a refused call's span ends after its client
    has the status, when the server's coroutine resumes."""
    spans = await asyncio.to_thread(
        receiver.wait_for,
        lambda spans: len(found := spans_of_request(spans, request_id)) >= count and found,
        what=f"{count} spans of {request_id}",
    )
    return by_name(spans)


async def test_a_call_continues_the_callers_trace_down_to_the_engine_phases(
    generation, receiver, server
):
    metadata = (traceparent(), ("x-request-id", "traced-1"))
    response = await generation.Generate(request(max_tokens=6), metadata=metadata)
    assert len(response.token_ids) == 6
    spans = await request_spans(receiver, "traced-1", 2 + len(ENGINE_PHASES))
    call, engine = spans[GENERATE], spans["llm_request"]
    assert (call.trace_id, call.parent_span_id) == (CLIENT_TRACE_ID, CLIENT_SPAN_ID)
    assert call.kind == SPAN_KIND_SERVER and call.service_name == "llmrpc"
    assert call.attributes["rpc.grpc.status_code"] == 0
    assert call.attributes["rpc.method"] == "Generate"
    assert engine.parent_span_id == call.span_id
    assert {spans[name].parent_span_id for name in ENGINE_PHASES} == {engine.span_id}
    assert all(span.trace_id == CLIENT_TRACE_ID for span in spans.values())
    attributes = engine.attributes
    assert attributes["gen_ai.usage.completion_tokens"] == 6
    assert attributes["gen_ai.usage.prompt_tokens"] == response.usage.prompt_tokens
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.response.model"] == server.engine.model_info.served_model_names[0]
    assert attributes["llmrpc.engine.num_steps"] == 6  # one prompt step, five decode steps


async def test_engine_phases_follow_each_other_inside_the_call(generation, receiver):
    await generation.Generate(request(max_tokens=8), metadata=(("x-request-id", "traced-2"),))
    spans = await request_spans(receiver, "traced-2", 2 + len(ENGINE_PHASES))
    call, engine = spans[GENERATE], spans["llm_request"]
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert call.start_ns <= engine.start_ns <= engine.end_ns <= call.end_ns
    assert engine.start_ns == queue.start_ns
    assert queue.end_ns == prefill.start_ns and prefill.end_ns == decode.start_ns
    assert decode.end_ns <= engine.end_ns
    assert all(s.end_ns >= s.start_ns for s in spans.values())
    assert prefill.end_ns > prefill.start_ns and decode.end_ns > decode.start_ns
    detokenize = spans["detokenize"]
    assert detokenize.start_ns == prefill.end_ns  # detokenization starts with the first token
    latency = engine.attributes
    seconds = (engine.end_ns - engine.start_ns) / 1e9
    assert 0 < latency["gen_ai.latency.time_to_first_token"] <= latency["gen_ai.latency.e2e"]
    assert abs(latency["gen_ai.latency.e2e"] - seconds) < 1e-3
    # --collect-detailed-traces all: the steps' times, within the engine's time for it
    forward = latency["gen_ai.latency.time_in_model_forward"]
    execute = latency["gen_ai.latency.time_in_model_execute"]
    assert 0 < forward <= execute <= latency["gen_ai.latency.time_in_model_inference"]


async def test_a_call_without_trace_context_starts_a_trace_of_its_own(generation, receiver):
    messages = [
        m
        async for m in generation.GenerateStream(
            request(max_tokens=3), metadata=(("x-request-id", "traced-3"),)
        )
    ]
    assert messages[-1].usage.completion_tokens == 3
    spans = await request_spans(receiver, "traced-3", 2 + len(ENGINE_PHASES))
    call = spans["llmrpc.v1.GenerationService/GenerateStream"]
    assert call.parent_span_id == "" and call.trace_id != CLIENT_TRACE_ID
    assert {span.trace_id for span in spans.values()} == {call.trace_id}


async def test_a_refused_call_has_an_error_span_with_its_status(generation, receiver):
    bad = request()
    bad.sampling.temperature = -1.0
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generation.Generate(bad, metadata=(traceparent(), ("x-request-id", "traced-4")))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = await request_spans(receiver, "traced-4", 1)
    call = spans[GENERATE]
    assert call.status_code == STATUS_ERROR
    assert call.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in call.status_message
    assert set(spans) == {GENERATE}  # refused before the engine: no engine spans


async def test_the_in_process_channel_is_traced_the_same(server, receiver):
    from llmrpc.v1 import generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationServiceStub(server.loopback)
    await stub.Generate(request(max_tokens=2), metadata=(traceparent(), ("x-request-id", "lb-1")))
    spans = await request_spans(receiver, "lb-1", 2 + len(ENGINE_PHASES))
    assert spans[GENERATE].parent_span_id == CLIENT_SPAN_ID
    assert spans["llm_request"].parent_span_id == spans[GENERATE].span_id
    assert spans["decode"].parent_span_id == spans["llm_request"].span_id


async def test_spans_still_buffered_are_exported_when_the_server_stops(tiny_llama_dir):
    """An export schedule longer than the test: only the server's stop can send them."""
    late = OtlpReceiver()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
            frontend = frontend_config("thread", tracing=TracingConfig(late.endpoint))
            running = await start_server(tiny_engine_config(tiny_llama_dir), frontend=frontend)
        from llmrpc.v1 import generation_pb2_grpc

        stub = generation_pb2_grpc.GenerationServiceStub(running.loopback)
        await stub.Generate(request(max_tokens=2), metadata=(("x-request-id", "drained"),))
        assert late.spans() == []
        await running.stop(grace=1)
        spans = by_name(spans_of_request(late.spans(), "drained"))
        assert {GENERATE, "llm_request", *ENGINE_PHASES} == set(spans)
        # No --collect-detailed-traces: no step times
        assert "gen_ai.latency.time_in_model_forward" not in spans["llm_request"].attributes
        assert "gen_ai.latency.time_in_model_execute" not in spans["llm_request"].attributes
    finally:
        late.stop()


async def test_timings_cross_from_the_engine_process_as_they_were():
    """The engine process sends outputs as msgpack (``engine/messages.py``)."""
    timings = RequestTimings(1.5, 2.0, 2.25, 3.0, 3.5, 4, 0.5, 0.75, 0.125)
    output = RequestOutput("r", "text", [1], finished=True, timings=timings)
    snapshot = messages.Snapshot(EngineStats(0, 0, 0, 0, 0.0, 0.0, 0.0, False), "cpu")
    encoded = msgspec.msgpack.encode(messages.Outputs([output], snapshot))
    decoded = msgspec.msgpack.Decoder(messages.FromCore).decode(encoded)
    assert decoded.outputs[0].timings == timings


# --- the flags ---------------------------------------------------------------------------------


def configs(*argv: str):
    parser = OneLineErrorParser(prog="llmrpc serve", add_help=False)
    options.add_serve_arguments(parser)
    return options.build_configs(options.parse_serve_values(parser, list(argv)))


async def test_the_flags_set_the_tracing_configuration():
    _, frontend = configs("--otlp-traces-endpoint", "http://collector:4317",
                          "--collect-detailed-traces", "model,worker")  # fmt: skip
    tracing = frontend.tracing
    assert tracing.otlp_traces_endpoint == "http://collector:4317"
    assert tracing.model_forward and tracing.model_execute
    _, frontend = configs("--otlp-traces-endpoint", "https://c:4317", "--collect-detailed-traces",
                          "worker")  # fmt: skip
    assert frontend.tracing.model_execute and not frontend.tracing.model_forward
    assert configs()[1].tracing.enabled is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--collect-detailed-traces", "all"), "requires --otlp-traces-endpoint"),
        (("--otlp-traces-endpoint", "http://c:4317", "--collect-detailed-traces", "gpu"),
         "'gpu' is not one of model, worker, all"),
        (("--otlp-traces-endpoint", "localhost:4317"), "must be an http:// or https:// URL"),
    ],
)  # fmt: skip
async def test_bad_tracing_flags_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        configs(*argv)


async def test_an_unknown_export_protocol_is_refused(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"):
        configs("--otlp-traces-endpoint", "http://c:4318/v1/traces")


async def test_without_the_flag_no_opentelemetry_sdk_is_imported():
    """A server built without --otlp-traces-endpoint (its interceptors, servicers and REST
    gateway) loads none of the SDK or exporters: start-up does not pay for them. (FastAPI
    imports the OpenTelemetry API itself, whatever the flags.)"""
    code = (
        "import sys\n"
        "from llmrpc.cli import rest\n"
        "from llmrpc.server import app\n"
        "from llmrpc.engine.config import EngineConfig\n"
        "from llmrpc.server.settings import FrontendConfig\n"
        "frontend = FrontendConfig(host='127.0.0.1', grpc_port=0)\n"
        "running = app.build_server(EngineConfig(), frontend)\n"
        "rest.in_process_gateway(frontend, running.loopback)\n"
        "loaded = ('opentelemetry.sdk', 'opentelemetry.exporter', 'opentelemetry.proto')\n"
        "print(sorted(m for m in sys.modules if m.startswith(loaded)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
