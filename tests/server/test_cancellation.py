"""Cancelled calls, expired deadlines and Abort free the engine's KV blocks at once.

The engine here is slowed to 20 ms a step, so a request of 400 tokens would stay live for about
eight seconds: a request that leaves the engine well before that was aborted, not finished.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from engine_pace import num_live_requests, slow_down
from server_utils import NUM_KV_BLOCKS, field_violations, read_rest, wait_until

from llmrpc.v1 import admin_pb2, common_pb2, generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = 400  # tokens; never reached in these tests (about 8 s)
SHORT = 80  # tokens of the requests that finish normally: about 1.6 s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(server):
    slow_down(server.engine, 0.02)
    return server


@pytest.fixture
def engine(server):
    assert num_live_requests(server.engine) == 0
    assert server.engine.stats.num_free_blocks == NUM_KV_BLOCKS
    return server.engine


def request(max_tokens: int, text: str = "Hello there", **fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text=text,
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )


async def finish(generation, req) -> generation_pb2.GenerateResponse:
    messages = [m async for m in generation.GenerateStream(req)]
    return messages[-1]


async def test_cancelled_stream_is_aborted_and_the_others_finish(any_generation, engine):
    generation = any_generation
    # The victim streams before the others start, so that all four are live together however
    # slowly the first request of a run is admitted.
    victim = generation.GenerateStream(request(LONG, text="A much longer prompt " * 4))
    messages = aiter(victim)
    for _ in range(3):
        await anext(messages)
    others = [
        asyncio.ensure_future(finish(generation, request(SHORT, text=f"Prompt number {i}")))
        for i in range(3)
    ]
    await wait_until(lambda: num_live_requests(engine) == 4, what="four live requests")
    victim.cancel()
    await wait_until(lambda: num_live_requests(engine) == 3, what="the victim's abort")
    assert not any(task.done() for task in others), "the others should still be running"
    for last in await asyncio.gather(*others):
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == SHORT
    await wait_until(lambda: num_live_requests(engine) == 0, what="no live requests")
    assert engine.stats.num_free_blocks == NUM_KV_BLOCKS


@pytest.mark.parametrize("streaming", [False, True])
async def test_expired_deadline_aborts_the_request(any_generation, engine, streaming):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        if streaming:
            [m async for m in any_generation.GenerateStream(request(LONG), timeout=0.3)]
        else:
            await any_generation.Generate(request(LONG), timeout=0.3)
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: num_live_requests(engine) == 0, timeout=5, what="the abort")
    assert engine.stats.num_free_blocks == NUM_KV_BLOCKS


async def test_abort_ends_a_live_stream_with_finish_reason_abort(admin, generation, engine):
    call = generation.GenerateStream(request(LONG, request_id="to-abort"))
    assert (await call.read()).request_id == "to-abort"
    aborted = await admin.Abort(admin_pb2.AbortRequest(request_ids=["to-abort", "unknown"]))
    assert list(aborted.aborted_request_ids) == ["to-abort"]
    last = (await read_rest(call))[-1]
    assert last.finish_reason == generation_pb2.FINISH_REASON_ABORT
    assert last.usage.completion_tokens < LONG
    again = await admin.Abort(admin_pb2.AbortRequest(request_ids=["to-abort"]))
    assert list(again.aborted_request_ids) == []
    assert engine.stats.num_free_blocks == NUM_KV_BLOCKS


async def test_a_live_request_id_cannot_be_reused(generation, engine):
    first = generation.GenerateStream(request(LONG, request_id="taken"))
    await first.read()
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(request(2, request_id="taken"))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == ["request_id"]
    first.cancel()
    await wait_until(lambda: num_live_requests(engine) == 0, what="the abort")


async def test_time_limit_ends_the_request_with_finish_reason_time_limit(generation, engine):
    req = request(LONG)
    req.stopping.time_limit_ms = 200
    response = await generation.Generate(req)
    assert response.finish_reason == generation_pb2.FINISH_REASON_TIME_LIMIT
    assert 0 < response.usage.completion_tokens < LONG
    assert len(response.token_ids) == response.usage.completion_tokens
