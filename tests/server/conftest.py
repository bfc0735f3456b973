"""Fixtures for server tests: an in-process gRPC server over the tiny model, channels, stubs.

Each test module gets one server on an OS-chosen loopback port; its tests run on the module's
event loop (``pytestmark = pytest.mark.asyncio(loop_scope="module")``), the loop the server's
grpc.aio machinery is bound to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from server_utils import tiny_engine_config

from llmrpc.server.app import RunningServer, start_server
from llmrpc.v1 import admin_pb2_grpc, generation_pb2_grpc, tokenization_pb2_grpc


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir: Path) -> AsyncIterator[RunningServer]:
    running = await start_server(tiny_engine_config(tiny_llama_dir), host="127.0.0.1", port=0)
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
