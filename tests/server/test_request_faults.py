"""A fault inside the engine that belongs to one request reaches its caller as INTERNAL naming
the request id; the requests beside it finish normally and the server goes on serving."""

from __future__ import annotations

import asyncio

import engine_hooks
import grpc
import pytest
import pytest_asyncio
from engine_plugin import call_in_core

from llmrpc.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")


def request(request_id: str, max_tokens: int = 16) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        text="A request among others",
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


@pytest_asyncio.fixture(loop_scope="module")
async def faulty_detokenizer(server):
    """The engine's detokenization raises for requests whose id starts with "bad-" (a generated
    id, hex, never does)."""
    engine = server.engine
    target = "output_processor.add_token"
    await call_in_core(engine, engine_hooks.fail_requests, target, "bad-", "unicode")
    yield
    await call_in_core(engine, engine_hooks.remove_faults)


@pytest.mark.parametrize("streaming", [False, True])
async def test_a_request_fault_is_internal_with_its_id_and_spares_the_others(
    generation, server, faulty_detokenizer, streaming
):
    good = [asyncio.ensure_future(generation.Generate(request(f"good-{i}"))) for i in range(3)]
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        if streaming:
            [m async for m in generation.GenerateStream(request("bad-stream"))]
        else:
            await generation.Generate(request("bad-unary"))
    assert failure.value.code() == grpc.StatusCode.INTERNAL
    assert ("bad-stream" if streaming else "bad-unary") in failure.value.details()
    assert "injected" in failure.value.details()
    for reply in await asyncio.gather(*good):
        assert reply.usage.completion_tokens == 16
    assert server.engine.is_running
