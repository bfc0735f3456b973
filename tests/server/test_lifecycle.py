"""Server lifecycle: NOT_SERVING while loading, graceful stop, SIGTERM drain, and a dead engine
(UNAVAILABLE, NOT_SERVING, ``serve`` exits with status 1)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import engine_hooks
import grpc
import httpx
import pytest
from engine_pace import num_live_requests, slow_down
from engine_plugin import call_in_core
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import (
    frontend_config,
    read_rest,
    serve_in_process,
    tiny_engine_config,
    wait_for_health,
    wait_until,
)

from llmrpc.cli import rest as rest_cli
from llmrpc.server import app
from llmrpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

REQUEST = generation_pb2.GenerateRequest(
    text="Hello", stopping=common_pb2.StoppingCriteria(max_tokens=4, ignore_eos=True)
)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def break_engine(engine) -> None:
    await call_in_core(engine, engine_hooks.break_steps, "simulated device fault")


async def test_not_serving_while_loading_then_serving(tiny_llama_dir, engine_mode):
    engine_config = tiny_engine_config(tiny_llama_dir)
    frontend = frontend_config(engine_mode)
    running = await app.bind_server(engine_config, frontend)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            await wait_for_health(channel, NOT_SERVING, timeout=0)
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await generation_pb2_grpc.GenerationServiceStub(channel).Generate(REQUEST)
            assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
            await running.load(engine_config, frontend)
            await wait_for_health(channel, SERVING, timeout=0)
    finally:
        await running.stop(grace=0)


async def test_stop_lets_an_in_flight_stream_finish(tiny_llama_dir, engine_mode):
    frontend = frontend_config(engine_mode)
    running = await app.start_server(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    slow_down(running.engine, 0.02)
    async with grpc.aio.insecure_channel(running.address) as channel:
        request = generation_pb2.GenerateRequest()
        request.CopyFrom(REQUEST)
        request.stopping.max_tokens = 25
        call = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(request)
        await call.read()
        stopping = asyncio.ensure_future(running.stop(grace=30))
        last = (await read_rest(call))[-1]
        await stopping
    assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 25
    assert not running.engine.is_running


async def test_dead_engine_gives_unavailable_and_not_serving(tiny_llama_dir, engine_mode):
    frontend = frontend_config(engine_mode)
    running = await app.start_server(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            await wait_for_health(channel, SERVING, timeout=0)
            await break_engine(running.engine)
            generation = generation_pb2_grpc.GenerationServiceStub(channel)
            for _ in range(2):  # the request that meets the fault, then one after it
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    await generation.Generate(REQUEST)
                assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
            await wait_until(lambda: running.engine_failure is not None, what="on_dead")
            await wait_for_health(channel, NOT_SERVING, timeout=5)
    finally:
        await running.stop(grace=0)


async def test_serve_exits_with_status_1_when_the_engine_dies(
    tiny_llama_dir, monkeypatch, engine_mode
):
    frontend = frontend_config(engine_mode)
    serving, running = await serve_in_process(tiny_llama_dir, frontend, monkeypatch)
    async with grpc.aio.insecure_channel(running.address) as channel:
        await break_engine(running.engine)
        with pytest.raises(grpc.aio.AioRpcError):
            await generation_pb2_grpc.GenerationServiceStub(channel).Generate(REQUEST)
    assert await asyncio.wait_for(serving, timeout=30) == 1


async def test_sigterm_drains_then_stops_and_the_stream_in_flight_finishes(
    tiny_llama_dir, monkeypatch, engine_mode
):
    frontend = frontend_config(engine_mode, drain_delay_s=0.5, shutdown_grace_s=30)
    serving, running = await serve_in_process(tiny_llama_dir, frontend, monkeypatch)
    async with grpc.aio.insecure_channel(running.address) as channel:
        statuses = []
        watching = asyncio.ensure_future(record_health(channel, statuses))
        generation = generation_pb2_grpc.GenerationServiceStub(channel)
        slow_down(running.engine, 0.02)
        stream = generation.GenerateStream(long_request(100))
        await stream.read()
        os.kill(os.getpid(), signal.SIGTERM)
        await wait_until(lambda: statuses[-1:] == [NOT_SERVING], what="NOT_SERVING")
        assert (await generation.Generate(REQUEST)).usage.completion_tokens == 4  # draining
        assert await refused_on_a_new_connection(running.address) == grpc.StatusCode.UNAVAILABLE
        assert not stream.done()
        last = (await read_rest(stream))[-1]
        assert await asyncio.wait_for(serving, timeout=30) == 0
        await watching  # the server ended the Watch stream once the stream in flight was done
    assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 100
    assert statuses == [SERVING, NOT_SERVING]


async def test_sigterm_drains_the_rest_gateway_and_its_stream_in_flight_finishes(
    tiny_llama_dir, monkeypatch, engine_mode
):
    gateways = []
    real_gateway = rest_cli.in_process_gateway

    def build_and_record(*args):
        gateways.append(real_gateway(*args))
        return gateways[-1]

    monkeypatch.setattr(rest_cli, "in_process_gateway", build_and_record)
    frontend = frontend_config(engine_mode, drain_delay_s=1.0, shutdown_grace_s=30)
    serving, running = await serve_in_process(tiny_llama_dir, frontend, monkeypatch, with_rest=True)
    url = f"http://127.0.0.1:{gateways[0].port}"
    body = {"prompt": "Hello", "max_tokens": 150, "ignore_eos": True, "stream": True}
    short = {"prompt": "Hi", "max_tokens": 1}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        await wait_until(lambda: _status_is(http, "/health", 200), what="REST health 200")
        slow_down(running.engine, 0.02)
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            events = reply.aiter_lines()
            assert (await anext(events)).startswith("data: {")
            os.kill(os.getpid(), signal.SIGTERM)
            # as gRPC: health NOT_SERVING at once, new calls served for the drain delay...
            await wait_until(lambda: _status_is(http, "/health", 503), what="REST health 503")
            during = await http.post("/v1/completions", json=short)
            assert during.status_code == 200, during.text
            # ...then refused (503) while the stream in flight goes on
            await wait_until(
                lambda: _post_status_is(http, short, 503), timeout=20, what="new calls refused"
            )
            assert num_live_requests(running.engine) == 1
            rest = [line async for line in events if line]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert await asyncio.wait_for(serving, timeout=30) == 0


async def _status_is(http: httpx.AsyncClient, path: str, status: int) -> bool:
    return (await http.get(path)).status_code == status


async def _post_status_is(http: httpx.AsyncClient, body: dict, status: int) -> bool:
    return (await http.post("/v1/completions", json=body)).status_code == status


def long_request(max_tokens: int) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest()
    request.CopyFrom(REQUEST)
    request.stopping.max_tokens = max_tokens
    return request


async def record_health(channel, statuses: list) -> None:
    """Append each status a health Watch reports until the server ends the stream."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for response in watch:
            statuses.append(response.status)


async def refused_on_a_new_connection(address: str, timeout: float = 5.0) -> grpc.StatusCode:
    """Call on new connections until one is refused (the drain delay has passed); its code.

    A call racing the very start of the shutdown may end CANCELLED instead: try again.
    """
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            try:
                await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.CANCELLED:
                    return error.code()
        await asyncio.sleep(0.05)
    pytest.fail(f"calls were still served {timeout} s after SIGTERM")


async def test_a_second_sigterm_ends_the_calls_in_flight_with_unavailable(
    tiny_llama_dir, monkeypatch, engine_mode
):
    frontend = frontend_config(engine_mode, drain_delay_s=30, shutdown_grace_s=30)
    serving, running = await serve_in_process(tiny_llama_dir, frontend, monkeypatch)
    async with grpc.aio.insecure_channel(running.address) as channel:
        slow_down(running.engine, 0.02)
        stream = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(
            long_request(400)
        )
        await stream.read()
        os.kill(os.getpid(), signal.SIGTERM)
        await wait_for_health(channel, NOT_SERVING, timeout=5)
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await read_rest(stream)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.wait_for(serving, timeout=10) == 0  # neither delay waited out
    assert num_live_requests(running.engine) == 0
