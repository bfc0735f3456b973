"""The in-process channel (what ``llmrpc serve``'s REST gateway calls through) behaves as the
network one: same outputs, same statuses, details and request ids, the API key, and refusal once
the server stops. (Deadlines and cancellation over both channels: ``test_cancellation``.)
"""

from __future__ import annotations

import grpc
import pytest
from engine_pace import slow_down
from server_utils import bound_server, field_violations, tiny_engine_config

from llmrpc.server.app import start_server
from llmrpc.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = 400  # tokens; never reached here


def request(max_tokens: int, text: str = "Hello there", **fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text=text, stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens), **fields
    )


async def test_streams_are_the_same_over_both_channels(server, channel):
    """The same seeded request streams the same text, tokens, finish and usage over both. How
    the tokens split into messages is timing (tokens that come faster than they are read are
    sent together), so the messages are compared joined."""
    req = request(48, text="The capital of France is", sampling=common_pb2.SamplingParams(seed=7))
    network = generation_pb2_grpc.GenerationServiceStub(channel)
    in_process = generation_pb2_grpc.GenerationServiceStub(server.loopback)
    over_network = [m async for m in network.GenerateStream(req)]
    over_loopback = [m async for m in in_process.GenerateStream(req)]
    assert len(over_loopback) > 1
    assert _joined(over_loopback) == _joined(over_network)
    assert _joined(over_loopback)[-1] == 48


def _joined(messages: list[generation_pb2.GenerateResponse]) -> tuple:
    last = messages[-1]
    usage = last.usage.completion_tokens if last.HasField("usage") else None
    text = "".join(m.text for m in messages)
    return text, [t for m in messages for t in m.token_ids], last.finish_reason, usage


@pytest.mark.parametrize("streaming", [False, True])
async def test_bad_argument_status_details_and_request_id(any_generation, streaming):
    bad = request(8, request_id="bad-one")
    bad.sampling.temperature = -1
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        if streaming:
            [m async for m in any_generation.GenerateStream(bad)]
        else:
            await any_generation.Generate(bad)
    error = failure.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in error.details()
    assert field_violations(error) == ["sampling.temperature"]
    assert ("x-request-id", "bad-one") in tuple(error.initial_metadata())


async def test_unknown_method_is_unimplemented(server):
    missing = server.loopback.unary_unary("/llmrpc.v1.GenerationService/Nothing")
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await missing(generation_pb2.GenerateRequest())
    assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_the_api_key_applies_in_process():
    async with bound_server(api_key=("secret",)) as running:
        admin = admin_pb2_grpc.AdminServiceStub(running.loopback)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await admin.GetServerInfo(admin_pb2.GetServerInfoRequest())
        assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = await admin.GetServerInfo(
            admin_pb2.GetServerInfoRequest(), metadata=(("authorization", "Bearer secret"),)
        )
        assert info.capabilities.auth_required


async def test_a_stopping_server_ends_calls_past_the_grace_and_refuses_new_ones(tiny_llama_dir):
    running = await start_server(tiny_engine_config(tiny_llama_dir), host="127.0.0.1", port=0)
    slow_down(running.engine, 0.02)
    stub = generation_pb2_grpc.GenerationServiceStub(running.loopback)
    call = stub.GenerateStream(request(LONG))
    messages = aiter(call)
    await anext(messages)
    await running.stop(grace=0.2)
    with pytest.raises(grpc.aio.AioRpcError) as cut:
        async for _ in messages:
            pass
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(request(4))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
