"""``Client`` and ``AsyncClient`` against a running server: each test runs through both."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from client_utils import wait_until
from engine_pace import num_live_requests, restore_speed, slow_down

from llmrpc.clients import Client, FinishReason, LlmrpcError, RetryPolicy
from llmrpc.v1 import generation_pb2

GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def test_generate_returns_the_whole_output(call):
    completion = await call("generate", "The capital of France is", max_tokens=5, **GREEDY)
    assert len(completion.token_ids) == 5
    assert completion.finish_reason is FinishReason.LENGTH
    assert completion.usage.completion_tokens == 5
    assert completion.text == await call("detokenize", completion.token_ids)
    prompt = await call("tokenize", "The capital of France is")
    assert completion.usage.prompt_tokens == prompt.count


async def test_stream_deltas_add_up_to_the_unary_output(call):
    whole = await call("generate", [100, 200, 300], max_tokens=6, **GREEDY)
    deltas = await call.collect("stream", [100, 200, 300], max_tokens=6, **GREEDY)
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].usage.prompt_tokens == 3
    assert deltas[-1].usage.completion_tokens == 6


async def test_chat_renders_the_template(call):
    messages = [{"role": "user", "content": "Hello there"}]
    completion = await call("chat", messages, max_tokens=3, **GREEDY)
    rendered = await call("tokenize", messages=messages)
    assert completion.usage.prompt_tokens == rendered.count
    deltas = await call.collect("chat_stream", messages, max_tokens=3, **GREEDY)
    assert [t for d in deltas for t in d.token_ids] == completion.token_ids


async def test_n_samples(call):
    completion = await call("generate", "Hello", n=2, max_tokens=4, seed=7, ignore_eos=True)
    assert [s.index for s in completion.samples] == [0, 1]
    assert completion.token_ids == completion.samples[0].token_ids
    assert completion.usage.completion_tokens == 8
    deltas = await call.collect("stream", "Hello", n=2, max_tokens=4, seed=7, ignore_eos=True)
    for sample in completion.samples:  # the same seed gives the same samples
        mine = [d for d in deltas if d.index == sample.index]
        assert [t for d in mine for t in d.token_ids] == sample.token_ids
        assert mine[-1].finish_reason is FinishReason.LENGTH


async def test_logprobs_of_output_and_prompt_tokens(call):
    completion = await call(
        "generate", [100, 200, 300], max_tokens=3, logprobs=2, prompt_logprobs=1, **GREEDY
    )
    assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    for entry in completion.logprobs:
        assert entry.rank == 1  # greedy picks the most likely token
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    assert [lp.token_id for lp in completion.prompt_logprobs] == [200, 300]
    deltas = await call.collect("stream", [100, 200, 300], max_tokens=3, logprobs=0, **GREEDY)
    assert [lp.token_id for d in deltas for lp in d.logprobs] == completion.token_ids


async def test_stop_string_is_reported(call):
    first = await call("generate", "Hello", max_tokens=8, **GREEDY)
    stop = (await call("detokenize", first.token_ids[2:3])).strip()  # well before the 8th token
    completion = await call("generate", "Hello", max_tokens=8, stop=stop, **GREEDY)
    assert completion.finish_reason is FinishReason.STOP_STRING
    assert completion.matched_stop == stop
    assert stop not in completion.text


async def test_tokenize_and_detokenize_round_trip(call):
    tokens = await call("tokenize", "Hello world", add_special_tokens=False)
    assert tokens.count == len(tokens.token_ids) == len(tokens.token_strings)
    assert tokens.max_model_len == 512
    assert await call("detokenize", tokens.token_ids) == "Hello world"


async def test_models_and_info_describe_the_served_model(call, server):
    models = await call("models")
    info = await call("model_info")
    assert [m.id for m in models] == [info.model]
    assert models[0].max_model_len == info.max_model_len == 512
    assert info.default_stopping["max_tokens"] == 16
    assert info.has_chat_template
    assert (info.runner, info.embedding_size) == ("generate", None)
    server_info = await call("server_info")
    assert server_info.api_version == "v1"
    assert "llmrpc.v1.GenerationService" in server_info.services
    assert server_info.config["max_model_len"] == "512"


async def test_health_says_serving(call):
    assert await call("health") == "SERVING"
    assert await call("health", "llmrpc.v1.GenerationService") == "SERVING"


async def test_request_id_is_the_callers(call):
    completion = await call("generate", "Hi", max_tokens=1, request_id="my-request-1")
    assert completion.request_id == "my-request-1"
    deltas = await call.collect("stream", "Hi", max_tokens=1, request_id="my-request-2")
    assert {d.request_id for d in deltas} == {"my-request-2"}


async def test_abort_ends_a_running_request(call, server):
    engine = server.running.engine
    slow_down(engine, 0.02)
    try:
        request_id = f"abort-me-{call.is_async}"
        generation = asyncio.create_task(
            call("generate", "Hi", max_tokens=400, request_id=request_id, **GREEDY)
        )
        await wait_until(lambda: num_live_requests(engine) == 1, what="the request to start")
        assert await call("abort", request_id, "no-such-request") == [request_id]
        completion = await generation
        assert completion.finish_reason is FinishReason.ABORT
        assert len(completion.token_ids) < 400
    finally:
        restore_speed(engine)


async def test_leaving_a_stream_early_cancels_the_request(server):
    engine = server.running.engine
    slow_down(engine, 0.02)
    try:
        with Client(server.address) as client:
            deltas = client.stream("Hi", max_tokens=400, **GREEDY)
            next(deltas)
            assert num_live_requests(engine) == 1
            deltas.close()
            await wait_until(lambda: num_live_requests(engine) == 0, what="the request to end")
    finally:
        restore_speed(engine)


async def test_errors_carry_code_and_field_violations(call):
    with pytest.raises(LlmrpcError) as caught:
        await call("generate", "Hi", top_p=5.0)
    error = caught.value
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in error.field_violations] == ["sampling.top_p"]
    with pytest.raises(LlmrpcError) as caught:
        await call("generate", "Hi", presence_penalty=5.0)
    assert [v.field for v in caught.value.field_violations] == ["sampling.presence_penalty"]
    with pytest.raises(LlmrpcError) as caught:
        await call("generate", "Hi", model="no-such-model")
    assert caught.value.code_name == "NOT_FOUND"
    assert caught.value.details.resource.resource_name == "no-such-model"
    assert caught.value.request_id  # the server's, to find the call in its logs


async def test_a_deadline_that_passes_is_deadline_exceeded(call, server):
    engine = server.running.engine
    slow_down(engine, 0.02)
    try:
        with pytest.raises(LlmrpcError) as caught:
            await call("generate", "Hi", max_tokens=400, timeout=0.2, **GREEDY)
        assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_until(lambda: num_live_requests(engine) == 0, what="the request to end")
    finally:
        restore_speed(engine)


async def test_misspelled_parameters_fail_before_sending(call):
    with pytest.raises(TypeError, match="temprature"):
        await call("generate", "Hi", temprature=0.5)


async def test_no_server_is_unavailable_after_retries(unused_tcp_port):
    retry = RetryPolicy(max_attempts=2, initial_backoff=0.01)
    with (
        Client(f"127.0.0.1:{unused_tcp_port}", retry=retry) as client,
        pytest.raises(LlmrpcError) as caught,
    ):
        client.models()
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE


def test_finish_reasons_cover_the_proto_enum():
    names = {
        value.name.removeprefix("FINISH_REASON_").lower()
        for value in generation_pb2.FinishReason.DESCRIPTOR.values
        if value.number != generation_pb2.FINISH_REASON_UNSPECIFIED
    }
    assert names == {reason.value for reason in FinishReason}
