"""Churn: thousands of clients that hang up at every instant cost the server nothing.

Bounded in count and time, on loopback: channels closed right after a stream starts, calls
with deadlines of a few milliseconds, and streams cancelled after a random number of tokens.
Afterwards the server still serves, and GetLoad shows nothing running, nothing waiting and no
KV block in use.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import pytest_asyncio
from engine_pace import slow_down
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.server.app import start_server
from llmrpc.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

NUM_HANG_UPS = 1000  # channels closed right after GenerateStream starts
NUM_TIGHT_DEADLINES = 1000  # unary calls with 0.2-5 ms deadlines
NUM_CANCELLED_STREAMS = 200  # streams cancelled after 0-5 messages
NUM_KV_BLOCKS = 128


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
        cache=CacheConfig(num_gpu_blocks_override=NUM_KV_BLOCKS),
    )
    running = await start_server(config, host="127.0.0.1", port=0)
    # Steps of 10 ms or more, as a real model's are: calls that arrive mid-step wait in the
    # engine's queue, where a caller that gives up leaves a cancelled hand-off behind.
    slow_down(running.engine, 0.01)
    yield running
    await running.stop(grace=0)


def request(max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text="Churn, churn, churn",
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


async def hang_up(address: str, rng: random.Random) -> None:
    channel = grpc.aio.insecure_channel(address)
    call = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(request(50))
    await asyncio.sleep(rng.choice((0, 0.001, 0.003, 0.01)))
    await channel.close()
    call.cancel()


async def tight_deadline(stub, rng: random.Random) -> None:
    try:
        await stub.Generate(request(20), timeout=rng.uniform(0.0002, 0.005))
    except grpc.aio.AioRpcError as error:
        assert error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


async def cancel_after(stub, num_messages: int) -> None:
    call = stub.GenerateStream(request(200))
    try:
        for _ in range(num_messages):
            await call.read()
    finally:
        call.cancel()


async def in_batches(make, count: int, batch: int = 50) -> None:
    for start in range(0, count, batch):
        await asyncio.gather(*(make() for _ in range(min(batch, count - start))))


async def assert_idle_and_serving(server, channel) -> None:
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    for _ in range(300):  # aborts are applied by the engine's next step: allow a moment
        load = await admin.GetLoad(admin_pb2.GetLoadRequest())
        figures = (load.num_running_requests, load.num_waiting_requests, load.kv_cache_usage)
        if figures == (0, 0, 0.0):
            break
        await asyncio.sleep(0.1)
    assert figures == (0, 0, 0.0), "requests or KV blocks left behind"
    assert server.engine.is_running
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reply = await generation_pb2_grpc.GenerationServiceStub(channel).Generate(request(8))
    assert reply.usage.completion_tokens == 8


async def keep_busy(stub, stop: asyncio.Event) -> None:
    """Long streams, one after another, so the engine thread is mid-step when calls arrive
    (their add_request then waits in its queue while the caller gives up)."""
    while not stop.is_set():
        async for _ in stub.GenerateStream(request(300)):
            if stop.is_set():
                break


async def test_clients_hanging_up_at_every_moment(server):
    address = f"127.0.0.1:{server.port}"
    rng = random.Random(7)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        stop = asyncio.Event()
        busy = [asyncio.ensure_future(keep_busy(stub, stop)) for _ in range(4)]
        await in_batches(lambda: hang_up(address, rng), NUM_HANG_UPS)
        await in_batches(lambda: tight_deadline(stub, rng), NUM_TIGHT_DEADLINES)
        await in_batches(lambda: cancel_after(stub, rng.randrange(6)), NUM_CANCELLED_STREAMS)
        stop.set()
        await asyncio.gather(*busy)
        await assert_idle_and_serving(server, channel)
