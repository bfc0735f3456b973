"""Abort reaches only the caller's own requests, unless the caller holds the admin key: a request
another key started is, to it, not found (not aborted, not listed)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from engine_pace import num_live_requests, restore_speed, slow_down
from server_utils import frontend_config, tiny_engine_config, wait_until

from llmrpc.server.app import RunningServer, start_server
from llmrpc.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALICE, BOB, ADMIN = "alice-key-0001", "bob-key-0002", "admin-key-0003"


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir, engine_mode) -> AsyncIterator[RunningServer]:
    frontend = frontend_config(engine_mode, api_key=(ALICE, BOB), admin_api_key=(ADMIN,))
    running = await start_server(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    yield running
    await running.stop(grace=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(server) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@contextlib.asynccontextmanager
async def live_stream(channel, server, request_id: str, key: str):
    """A slow stream started with ``key``, in flight (first message read) for the block."""
    slow_down(server.engine, 0.02)
    request = generation_pb2.GenerateRequest(
        text="The quick brown fox",
        request_id=request_id,
        stopping=common_pb2.StoppingCriteria(max_tokens=200, ignore_eos=True),
    )
    call = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(
        request, metadata=auth(key)
    )
    await call.read()
    try:
        yield call
    finally:
        call.cancel()
        restore_speed(server.engine)
        await wait_until(lambda: num_live_requests(server.engine) == 0, what="the stream's end")


async def abort(channel, key: str, *request_ids: str) -> list[str]:
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    response = await stub.Abort(admin_pb2.AbortRequest(request_ids=request_ids), metadata=auth(key))
    return list(response.aborted_request_ids)


async def test_another_keys_request_is_not_found_and_the_owner_aborts_it(channel, server):
    async with live_stream(channel, server, "alice-1", ALICE):
        assert await abort(channel, BOB, "alice-1") == []
        assert num_live_requests(server.engine) == 1  # still running
        assert await abort(channel, ALICE, "alice-1", "unknown") == ["alice-1"]
        await wait_until(lambda: num_live_requests(server.engine) == 0, what="the abort")


async def test_the_admin_key_aborts_any_request(channel, server):
    async with live_stream(channel, server, "bob-1", BOB):
        assert await abort(channel, ADMIN, "bob-1") == ["bob-1"]
        await wait_until(lambda: num_live_requests(server.engine) == 0, what="the abort")
