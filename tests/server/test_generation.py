"""GenerationService through the generated stubs, against an in-process server (tiny model)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from engine_pace import restore_speed, slow_down
from server_utils import field_violations

from llmrpc.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

FR = generation_pb2.FinishReason


def greedy_request(max_tokens: int = 12, **fields) -> generation_pb2.GenerateRequest:
    fields.setdefault("text", "The quick brown fox")
    return generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )


async def collect_stream(generation, request) -> list[generation_pb2.GenerateResponse]:
    return [response async for response in generation.GenerateStream(request)]


async def test_generate_returns_text_tokens_and_usage(generation, server):
    response = await generation.Generate(greedy_request(max_tokens=12))
    prompt = server.tokenization.tokenizer.encode("The quick brown fox")
    assert len(response.token_ids) == 12
    assert response.text == server.tokenization.tokenizer.decode(response.token_ids)
    assert response.finish_reason == FR.FINISH_REASON_LENGTH
    assert response.WhichOneof("matched_stop") is None
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == 12
    assert response.request_id  # the server made one


async def test_stream_deltas_concatenate_to_the_unary_output(generation, server):
    unary = await generation.Generate(greedy_request(max_tokens=20))
    # 20 ms a step: a stream reader that lags the engine gets its deltas merged, and the tiny
    # model's 20 steps could all pass within one lag of a busy machine's
    slow_down(server.engine, 0.02)
    try:
        messages = await collect_stream(generation, greedy_request(max_tokens=20))
    finally:
        restore_speed(server.engine)
    assert len(messages) > 1
    assert "".join(m.text for m in messages) == unary.text
    assert [t for m in messages for t in m.token_ids] == list(unary.token_ids)
    *middle, last = messages
    assert all(m.finish_reason == FR.FINISH_REASON_UNSPECIFIED for m in middle)
    assert not any(m.HasField("usage") for m in middle)
    assert last.finish_reason == FR.FINISH_REASON_LENGTH
    assert last.usage == unary.usage
    assert len({m.request_id for m in messages}) == 1


async def test_unset_max_tokens_means_sixteen(generation):
    request = greedy_request()
    request.stopping.ClearField("max_tokens")
    response = await generation.Generate(request)
    assert response.usage.completion_tokens == 16


async def test_token_ids_input_is_used_as_given(generation, server):
    ids = server.tokenization.tokenizer.encode("The quick brown fox")
    by_text = await generation.Generate(greedy_request())
    by_ids = await generation.Generate(
        greedy_request(text=None, token_ids=common_pb2.TokenIds(ids=ids))
    )
    assert by_ids.token_ids == by_text.token_ids
    assert by_ids.usage.prompt_tokens == len(ids)


async def test_chat_input_is_rendered_with_the_chat_template(generation, server):
    chat = common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi there")])
    response = await generation.Generate(greedy_request(text=None, chat=chat))
    rendered = server.tokenization.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    prompt = server.tokenization.tokenizer.encode(rendered, add_special_tokens=False)
    assert response.usage.prompt_tokens == len(prompt)


async def test_stop_token_reports_the_matched_token(generation):
    first = await generation.Generate(greedy_request(max_tokens=8))
    stop_token = first.token_ids[3]
    request = greedy_request(max_tokens=8)
    request.stopping.stop_token_ids.append(stop_token)
    response = await generation.Generate(request)
    assert response.finish_reason == FR.FINISH_REASON_STOP_TOKEN
    assert response.stop_token_id == stop_token
    assert response.token_ids[-1] == stop_token
    assert list(response.token_ids) == list(first.token_ids[: len(response.token_ids)])


async def test_stop_string_is_cut_and_reported(generation):
    first = await generation.Generate(greedy_request(max_tokens=16))
    stop = first.text[len(first.text) // 2 :][:3]
    assert stop.strip(), f"no usable stop string in {first.text!r}"
    request = greedy_request(max_tokens=16)
    request.stopping.stop.append(stop)
    messages = await collect_stream(generation, request)
    text = "".join(m.text for m in messages)
    assert messages[-1].finish_reason == FR.FINISH_REASON_STOP_STRING
    assert messages[-1].stop_string == stop
    assert text == first.text[: first.text.index(stop)]


async def test_request_id_is_taken_from_the_request_then_metadata(generation):
    call = generation.Generate(greedy_request(max_tokens=2, request_id="from-field"))
    assert (await call).request_id == "from-field"
    assert ("x-request-id", "from-field") in tuple(await call.initial_metadata())
    call = generation.GenerateStream(
        greedy_request(max_tokens=2), metadata=(("x-request-id", "from-metadata"),)
    )
    messages = [m async for m in call]
    assert {m.request_id for m in messages} == {"from-metadata"}
    assert ("x-request-id", "from-metadata") in tuple(await call.initial_metadata())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.ClearField("text"), "input"),
        (lambda r: setattr(r, "text", ""), "text"),
        (lambda r: r.token_ids.SetInParent(), "token_ids"),
        (lambda r: setattr(r.sampling, "temperature", -0.5), "sampling.temperature"),
        (lambda r: setattr(r.sampling, "top_p", 1.5), "sampling.top_p"),
        (lambda r: setattr(r.stopping, "max_tokens", 100_000), "stopping.max_tokens"),
        (lambda r: r.token_ids.ids.append(10**9), "token_ids"),
        (lambda r: r.chat.SetInParent(), "chat.messages"),
        (lambda r: setattr(r.stopping, "time_limit_ms", 0), "stopping.time_limit_ms"),
    ],
)
async def test_bad_request_is_invalid_argument_naming_the_field(generation, change, field):
    request = greedy_request()
    change(request)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(request)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == [field]


async def test_unknown_model_is_not_found(generation, server):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(greedy_request(model="no-such-model"))
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    assert field_violations(failure.value) == ["model"]
    served = server.engine.model_info.served_model_names[0]
    assert (await generation.Generate(greedy_request(max_tokens=2, model=served))).token_ids


async def test_bad_requests_do_not_disturb_a_concurrent_good_one(generation):
    good = asyncio.ensure_future(collect_stream(generation, greedy_request(max_tokens=64)))
    bad = greedy_request()
    bad.sampling.temperature = -1.0
    for _ in range(5):
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await generation.Generate(bad)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    messages = await good
    assert messages[-1].finish_reason == FR.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == 64
