"""Fixtures for server tests: an in-process gRPC server over the tiny model, channels, stubs.

Each test module gets one server on an OS-chosen loopback port; its tests run on the module's
event loop (``pytestmark = pytest.mark.asyncio(loop_scope="module")``), the loop the server's
grpc.aio machinery is bound to.

Engine modes: the modules of ``BOTH_MODES`` (generation, cancellation and abort, admin with
sleep and wake, request faults, lifecycle and drain) run once with the engine
core in a process of its own and once on a thread of the server's process (the
``engine_mode`` fixture; ``server_utils.frontend_config``). Other modules run in one mode,
``$LLMRPC_TEST_ENGINE_MODE`` ("thread" unless set: it starts in under a second; several of
those modules reach into the engine core directly).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from server_utils import ENGINE_MODES, frontend_config, tiny_engine_config

from llmrpc.server.app import RunningServer, start_server
from llmrpc.v1 import admin_pb2_grpc, generation_pb2_grpc, tokenization_pb2_grpc

BOTH_MODES = frozenset(
    {
        "test_generation",
        "test_cancellation",
        "test_abort_owners",
        "test_admin",
        "test_request_faults",
        "test_lifecycle",
    }
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine_mode" in metafunc.fixturenames and metafunc.module.__name__ in BOTH_MODES:
        metafunc.parametrize("engine_mode", ENGINE_MODES, scope="module")


@pytest.fixture(scope="module")
def engine_mode() -> str:
    """Where the module's engine cores run (the modules of BOTH_MODES: each mode in turn)."""
    return os.environ.get("LLMRPC_TEST_ENGINE_MODE", "thread")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir: Path, engine_mode: str) -> AsyncIterator[RunningServer]:
    frontend = frontend_config(engine_mode)
    running = await start_server(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    yield running
    await running.stop(grace=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@pytest.fixture(scope="module")
def generation(channel) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(channel)


@pytest.fixture(params=["network", "in-process"])
def any_generation(request, server, channel) -> generation_pb2_grpc.GenerationServiceStub:
    """GenerationService over the network, then over the server's in-process channel (the REST
    gateway's way in)."""
    chosen = channel if request.param == "network" else server.loopback
    return generation_pb2_grpc.GenerationServiceStub(chosen)


@pytest.fixture(scope="module")
def tokenization(channel) -> tokenization_pb2_grpc.TokenizationServiceStub:
    return tokenization_pb2_grpc.TokenizationServiceStub(channel)


@pytest.fixture(scope="module")
def admin(channel) -> admin_pb2_grpc.AdminServiceStub:
    return admin_pb2_grpc.AdminServiceStub(channel)
