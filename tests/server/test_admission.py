"""The waiting-queue bound counts samples: a request for n samples takes n places (issue 10,
part 6: n=1000 used to pass --max-waiting-requests as one request)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest
import pytest_asyncio
from engine_pace import restore_speed, slow_down
from server_utils import field_violations, tiny_engine_config, wait_until

from llmrpc.engine.config import SchedulerConfig
from llmrpc.server.app import RunningServer, start_server
from llmrpc.server.errors import InvalidArgument, ResourceExhausted
from llmrpc.server.limits import AdmissionControl
from llmrpc.server.settings import FrontendConfig, LimitsConfig
from llmrpc.v1 import common_pb2, generation_pb2

on_the_servers_loop = pytest.mark.asyncio(loop_scope="module")

MAX_WAITING = 4


def engine_running(num_running: int) -> SimpleNamespace:
    return SimpleNamespace(stats=SimpleNamespace(num_running=num_running))


def test_each_sample_takes_a_place_in_the_queue():
    admission = AdmissionControl(MAX_WAITING)
    engine = engine_running(0)
    with admission.admit(engine, num_samples=3):
        with admission.admit(engine, num_samples=1):
            pass  # 4 waiting: full, not over
        with pytest.raises(ResourceExhausted), admission.admit(engine, num_samples=2):
            pass
        engine.stats.num_running = 3  # the three samples start: their places free up
        with admission.admit(engine, num_samples=MAX_WAITING):
            pass
    assert admission.num_in_flight == 0


def test_more_samples_than_the_queue_holds_can_never_be_admitted():
    admission = AdmissionControl(MAX_WAITING)
    with (
        pytest.raises(InvalidArgument) as failure,
        admission.admit(engine_running(0), num_samples=MAX_WAITING + 1),
    ):
        pass
    assert failure.value.field == "sampling.n"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir) -> AsyncIterator[RunningServer]:
    """One request runs at a time; MAX_WAITING samples may wait."""
    engine_config = dataclasses.replace(
        tiny_engine_config(tiny_llama_dir), scheduler=SchedulerConfig(max_num_seqs=1)
    )
    frontend = FrontendConfig(
        host="127.0.0.1", grpc_port=0, limits=LimitsConfig(max_waiting_requests=MAX_WAITING)
    )
    running = await start_server(engine_config, frontend=frontend)
    yield running
    await running.stop(grace=0)


def request(max_tokens: int, n: int = 1) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text="Tell me a story",
        sampling=common_pb2.SamplingParams(temperature=0.0, n=n),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


@on_the_servers_loop
async def test_a_request_for_n_samples_fills_n_places(generation, server, monkeypatch):
    slow_down(server.engine, 0.02)
    try:
        running = generation.GenerateStream(request(max_tokens=200))
        await running.read()
        samples = generation.Generate(request(max_tokens=2, n=MAX_WAITING))
        await wait_until(lambda: server.engine.stats.num_waiting == MAX_WAITING, what="samples")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await generation.Generate(request(max_tokens=2))
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        running.cancel()
        assert len((await samples).samples) == MAX_WAITING
    finally:
        restore_speed(server.engine)


@on_the_servers_loop
async def test_n_beyond_the_queue_is_invalid_argument_naming_n(generation):
    for n in (MAX_WAITING + 1, 1000):
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await generation.Generate(request(max_tokens=2, n=n))
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(failure.value) == ["sampling.n"]
