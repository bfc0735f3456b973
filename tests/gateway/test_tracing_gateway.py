"""--otlp-traces-endpoint through the REST gateway: an OpenAI SDK call gives one trace, gateway
span -> gRPC span -> engine spans, over the network (``llmrpc gateway``) and over the in-process
channel (``llmrpc serve``), received by an in-process OTLP collector."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from envoy_support import Replica, ServerLoop, tiny_engine_config
from gateway_support import RunningGateway, running_gateway
from otlp_receiver import SPAN_KIND_SERVER, OtlpReceiver, ReceivedSpan

from llmrpc.server.settings import FrontendConfig
from llmrpc.server.tracing_config import TracingConfig

CLIENT_SPAN_ID = "b7ad6b7169203331"
ENGINE_SPANS = {"llm_request", "queue", "prefill", "decode", "detokenize"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # read when the providers are made
        started = OtlpReceiver()
        yield started
    started.stop()


@pytest.fixture(scope="module")
def replica(server_loop: ServerLoop, tiny_llama_dir: Path, receiver: OtlpReceiver):
    tracing = TracingConfig(receiver.endpoint)
    frontend = FrontendConfig(
        host="127.0.0.1", grpc_port=0, disable_frontend_multiprocessing=True, tracing=tracing
    )
    started = server_loop.start_replica(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    yield started
    started.stop()


@pytest.fixture(scope="module", params=["network", "in-process"])
def gateway(request, server_loop, replica: Replica, receiver) -> Iterator[RunningGateway]:
    api = {"otlp_traces_endpoint": receiver.endpoint}
    if request.param == "network":
        targets, channels = [replica.address], None
    else:
        targets, channels = ["in-process"], {"in-process": replica.running.loopback}
    with running_gateway(server_loop, targets, channels=channels, api=api) as started:
        yield started


@pytest.fixture(scope="module")
def sdk(gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def one_trace(receiver: OtlpReceiver, request_id: str) -> list[ReceivedSpan]:
    """Every span of the trace whose gateway span carries ``request_id``, once the engine's
    spans have arrived too."""

    def complete(spans):
        roots = [s for s in spans if s.attributes.get("gen_ai.request.id") == request_id]
        gateway = [s for s in roots if "http.request.method" in s.attributes]
        if not gateway:
            return None
        trace = [s for s in spans if s.trace_id == gateway[0].trace_id]
        return trace if {s.name for s in trace} >= ENGINE_SPANS else None

    return receiver.wait_for(complete, what=f"the trace of {request_id}")


def chain(trace: list[ReceivedSpan]) -> tuple[ReceivedSpan, ReceivedSpan, ReceivedSpan]:
    """(gateway span, gRPC span, llm_request span), each the parent of the next. (The gateway
    may make other calls for the request, ListModels for one: their spans are its children
    too, each with its own call's request id.)"""
    (http,) = [s for s in trace if "http.request.method" in s.attributes]
    (engine,) = [s for s in trace if s.name == "llm_request"]
    (grpc_span,) = [s for s in trace if s.span_id == engine.parent_span_id]
    assert grpc_span.attributes["rpc.system"] == "grpc"
    assert grpc_span.parent_span_id == http.span_id
    assert all(s.attributes["gen_ai.request.id"] for s in trace)
    return http, grpc_span, engine


def request_ids(trace: list[ReceivedSpan], http: ReceivedSpan) -> set[str]:
    """The request ids of the gateway span, of the generation call and of its engine spans."""
    generation = [s for s in trace if s.name.startswith("llmrpc.v1.GenerationService/")]
    engine = [s for s in trace if s.name in ENGINE_SPANS]
    return {s.attributes["gen_ai.request.id"] for s in (http, *generation, *engine)}


def test_a_chat_completion_is_one_trace_from_the_callers_span_to_the_engine(sdk, gateway, receiver):
    request_id = f"rest-traced-{gateway.server.port}"  # one per gateway of the module
    client_trace_id = uuid.uuid4().hex
    headers = {
        "traceparent": f"00-{client_trace_id}-{CLIENT_SPAN_ID}-01",
        "x-request-id": request_id,
    }
    completion = sdk.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    assert completion.usage.completion_tokens == 4
    trace = one_trace(receiver, request_id)
    http, grpc_span, engine = chain(trace)
    assert (http.trace_id, http.parent_span_id) == (client_trace_id, CLIENT_SPAN_ID)
    assert http.kind == SPAN_KIND_SERVER and grpc_span.kind == SPAN_KIND_SERVER
    assert http.name == "POST /v1/chat/completions"
    assert http.attributes["http.response.status_code"] == 200
    assert engine.attributes["gen_ai.usage.completion_tokens"] == 4
    assert request_ids(trace, http) == {request_id}
    assert http.start_ns <= grpc_span.start_ns <= grpc_span.end_ns <= http.end_ns


def test_a_streamed_completion_without_trace_context_gets_a_trace_and_an_id(sdk, receiver):
    stream = sdk.completions.create(
        model="",
        prompt="Once upon a time",
        max_tokens=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    request_id = chunks[0].id.removeprefix("cmpl-")  # the gateway's own id for the request
    trace = one_trace(receiver, request_id)
    http, grpc_span, engine = chain(trace)
    assert http.parent_span_id == "" and http.name == "POST /v1/completions"
    assert grpc_span.attributes["rpc.method"] == "GenerateStream"
    assert request_ids(trace, http) == {request_id}
    assert http.end_ns >= engine.end_ns  # the span lasts until the stream's last byte


def test_a_refused_request_is_traced_with_its_status(gateway, receiver):
    request_id = f"rest-bad-{gateway.server.port}"
    response = httpx.post(
        gateway.url + "/v1/completions",
        json={"model": "", "prompt": "x", "max_tokens": -1},
        headers={"x-request-id": request_id},
        timeout=30,
    )
    assert response.status_code == 400
    (span,) = receiver.wait_for(
        lambda spans: [
            s
            for s in spans
            if s.attributes.get("gen_ai.request.id") == request_id
            and "http.request.method" in s.attributes
        ],
        what="the refused request's span",
    )
    assert span.attributes["http.response.status_code"] == 400
    assert span.status_code != 2  # a caller's mistake is not the server's error
