"""A frozen engine (its process stopped by SIGSTOP, or on a thread a step that does not return)
is noticed: health (gRPC for every service name, the --health-port server, REST /health) turns
NOT_SERVING once the engine has had work and not stepped for --engine-stall-timeout, and an idle
engine once it has not reported for that long (5 s at least); GetLoad says how old its figures
are and that the engine is stalled. When the engine steps again, SERVING again and the request
in flight finishes. An idle engine is never stalled merely for being idle. With data
parallelism, one stalled engine of two leaves the server SERVING and new requests go to the
other; all stalled: NOT_SERVING."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import grpc
import httpx
import pytest
from engine_pace import restore_speed, slow_down
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import frontend_config, read_rest, serve_in_process, wait_until

from llmrpc.cli import rest as rest_cli
from llmrpc.clients.types import load_from_proto
from llmrpc.server.state import SERVICE_NAMES
from llmrpc.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BOUND_S = 1.0  # --engine-stall-timeout in these tests
MAX_TOKENS = 150


def stream_request(max_tokens: int = MAX_TOKENS) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text="Hello", stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
    )


class Views:
    """Every view of the server's health: gRPC on its port for each service name, the health
    port, and REST /health."""

    def __init__(self, running, rest_url: str | None) -> None:
        self.running = running
        self.rest_url = rest_url

    async def statuses(self) -> set:
        found = set()
        addresses = [self.running.address]
        if self.running.health_port is not None:
            addresses.append(f"127.0.0.1:{self.running.health_port}")
        for address in addresses:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for name in ("", *SERVICE_NAMES):
                    request = health_pb2.HealthCheckRequest(service=name)
                    found.add((await stub.Check(request, timeout=5)).status)
        if self.rest_url is not None:
            async with httpx.AsyncClient(base_url=self.rest_url, timeout=5) as http:
                code = (await http.get("/health")).status_code
            found.add(SERVING if code == 200 else NOT_SERVING if code == 503 else code)
        return found

    async def all_are(self, status: int) -> bool:
        return await self.statuses() == {status}


async def get_load(running) -> admin_pb2.GetLoadResponse:
    async with grpc.aio.insecure_channel(running.address) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        return await stub.GetLoad(admin_pb2.GetLoadRequest(), timeout=5)


async def stop_serving(serving: asyncio.Future) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # as a service manager stops it
    assert await asyncio.wait_for(serving, timeout=60) == 0


@contextlib.contextmanager
def stopped(pid: int):
    """The process ``pid`` stopped (SIGSTOP) until the block ends (SIGCONT), whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def serve_with_rest(tiny_llama_dir, monkeypatch, frontend):
    gateways = []
    real_gateway = rest_cli.in_process_gateway

    def build_and_record(*args):
        gateways.append(real_gateway(*args))
        return gateways[-1]

    monkeypatch.setattr(rest_cli, "in_process_gateway", build_and_record)
    serving, running = await serve_in_process(
        tiny_llama_dir, frontend, monkeypatch, with_rest=True, timeout=120
    )
    views = Views(running, f"http://127.0.0.1:{gateways[0].port}")
    await wait_until(lambda: views.all_are(SERVING), timeout=30, what="SERVING everywhere")
    return serving, running, views


async def test_a_stopped_engine_process_with_a_request_in_flight_turns_health_not_serving(
    tiny_llama_dir, monkeypatch
):
    frontend = frontend_config("process", engine_stall_timeout_s=BOUND_S, health_port=0)
    serving, running, views = await serve_with_rest(tiny_llama_dir, monkeypatch, frontend)
    pid = running.engine.pid
    slow_down(running.engine, 0.02)  # the request stays in flight for a few seconds
    async with grpc.aio.insecure_channel(running.address) as channel:
        stream = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(stream_request())
        first = await stream.read()
        with stopped(pid):
            await wait_until(lambda: views.all_are(NOT_SERVING), timeout=30, what="NOT_SERVING")
            load = await get_load(running)
            assert load.HasField("engine_stalled") and load.engine_stalled
            assert load.figures_age_seconds >= BOUND_S
            assert load_from_proto(load).engine_stalled  # as the Python clients read it
        await wait_until(lambda: views.all_are(SERVING), timeout=30, what="SERVING again")
        rest = await read_rest(stream)
    tokens = len(first.token_ids) + sum(len(message.token_ids) for message in rest)
    assert rest[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert tokens == MAX_TOKENS
    load = await get_load(running)
    assert load.HasField("engine_stalled") and not load.engine_stalled
    assert load.HasField("figures_age_seconds")
    await stop_serving(serving)


async def test_an_idle_engine_is_not_stalled_but_a_stopped_idle_engine_process_is(
    tiny_llama_dir, monkeypatch
):
    frontend = frontend_config("process", engine_stall_timeout_s=BOUND_S)
    serving, running = await serve_in_process(tiny_llama_dir, frontend, monkeypatch, timeout=120)
    views = Views(running, None)
    statuses = []
    async with grpc.aio.insecure_channel(running.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())

        async def record():
            async for response in watch:
                statuses.append(response.status)

        recording = asyncio.ensure_future(record())
        await asyncio.sleep(4 * BOUND_S)  # idle, without a step, for several bounds
        assert statuses == [SERVING]
        assert not (await get_load(running)).engine_stalled
        with stopped(running.engine.pid):
            # idle, an engine reports every second: silent past the bound (5 s at least)
            await wait_until(lambda: views.all_are(NOT_SERVING), timeout=30, what="NOT_SERVING")
            assert (await get_load(running)).engine_stalled
        await wait_until(lambda: views.all_are(SERVING), timeout=30, what="SERVING again")
        reply = await generation_pb2_grpc.GenerationServiceStub(channel).Generate(
            stream_request(4), timeout=30
        )
        assert len(reply.token_ids) == 4
        recording.cancel()
    assert statuses == [SERVING, NOT_SERVING, SERVING]
    await stop_serving(serving)


async def test_a_step_that_does_not_return_on_the_engine_thread_turns_health_not_serving(
    tiny_llama_dir, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="llmrpc.server.health")
    frontend = frontend_config("thread", engine_stall_timeout_s=BOUND_S, health_port=0)
    serving, running, views = await serve_with_rest(tiny_llama_dir, monkeypatch, frontend)
    async with grpc.aio.insecure_channel(running.address) as channel:
        stream = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(stream_request())
        first = await stream.read()
        slow_down(running.engine, 5.0)  # the next step holds the engine thread for 5 s
        try:
            await wait_until(lambda: views.all_are(NOT_SERVING), timeout=30, what="NOT_SERVING")
            assert (await get_load(running)).engine_stalled
        finally:
            restore_speed(running.engine)
        await wait_until(lambda: views.all_are(SERVING), timeout=30, what="SERVING again")
        rest = await read_rest(stream)
    tokens = len(first.token_ids) + sum(len(message.token_ids) for message in rest)
    assert rest[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert tokens == MAX_TOKENS
    logged = [record.getMessage() for record in caplog.records]
    assert any("not stepped with 1 request(s) in flight" in line for line in logged), logged
    assert any("steps again after" in line for line in logged), logged
    await stop_serving(serving)


async def test_one_stopped_engine_of_two_is_skipped_and_both_stopped_is_not_serving(
    tiny_llama_dir, monkeypatch
):
    frontend = frontend_config("process", engine_stall_timeout_s=BOUND_S, data_parallel_size=2)
    serving, running = await serve_in_process(tiny_llama_dir, frontend, monkeypatch, timeout=180)
    views = Views(running, None)
    first, second = running.engine.pids
    async with grpc.aio.insecure_channel(running.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with stopped(second):
            await wait_until(
                lambda: _engines_stalled(running, [False, True]), timeout=30, what="engine 1"
            )
            assert await views.all_are(SERVING)
            load = await get_load(running)
            assert not load.engine_stalled
            replies = await asyncio.gather(
                *(stub.Generate(stream_request(4), timeout=30) for _ in range(4))
            )
            assert all(len(reply.token_ids) == 4 for reply in replies)
            assert running.engine.balancer.loads == [0, 0]  # none left waiting on engine 1
            with stopped(first):
                await wait_until(lambda: views.all_are(NOT_SERVING), timeout=30, what="both")
                assert (await get_load(running)).engine_stalled
        await wait_until(lambda: views.all_are(SERVING), timeout=30, what="SERVING again")
        await wait_until(lambda: _engines_stalled(running, [False, False]), timeout=30)
    await stop_serving(serving)


async def _engines_stalled(running, expected: list[bool]) -> bool:
    load = await get_load(running)
    return [engine.stalled for engine in load.engines] == expected
