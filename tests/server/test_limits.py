"""Transport limits take effect (gRPC ignores misspelt channel arguments silently): message
sizes, keepalive ping policing, connection age, concurrent streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import bound_server

from llmrpc.server.settings import LimitsConfig
from llmrpc.v1 import admin_pb2, admin_pb2_grpc

# A client that pings as often as gRPC lets it (about once a second), even with no call open.
PINGING_CLIENT = (
    ("grpc.keepalive_time_ms", 100),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.use_local_subchannel_pool", 1),
)


def health_request(size: int) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service="x" * size)


@contextlib.asynccontextmanager
async def channel_to_server(limits: LimitsConfig) -> AsyncIterator[grpc.aio.Channel]:
    async with (
        bound_server(limits=limits) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        yield channel


async def test_request_over_the_receive_limit_is_resource_exhausted():
    async with channel_to_server(LimitsConfig(max_receive_message_size=1024)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await health.Check(health_request(900))  # under the limit: reaches the servicer
        assert failure.value.code() == grpc.StatusCode.NOT_FOUND  # no such service
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await health.Check(health_request(2000))
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_response_over_the_send_limit_is_resource_exhausted():
    async with channel_to_server(LimitsConfig(max_send_message_size=256)) as channel:
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await admin.GetServerInfo(admin_pb2.GetServerInfoRequest())  # about 1.5 KiB
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def watch_until_closed(port: int, options=(), seconds: float = 4.0) -> grpc.StatusCode | None:
    """Hold a health Watch open; the code it ends with, or None if still open after ``seconds``."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        try:
            await asyncio.wait_for(read_until_the_end(watch), seconds)
        except asyncio.TimeoutError:
            return None
        except grpc.aio.AioRpcError as error:
            return error.code()
    pytest.fail("the Watch stream ended with OK")


async def read_until_the_end(call) -> None:
    async for _ in call:
        pass


async def test_a_client_pinging_more_often_than_allowed_is_disconnected():
    strict = LimitsConfig(min_ping_interval_s=10)
    lenient = LimitsConfig(min_ping_interval_s=0.05)
    async with bound_server(limits=strict) as policed, bound_server(limits=lenient) as tolerant:
        outcomes = await asyncio.gather(
            watch_until_closed(policed.port, PINGING_CLIENT),
            watch_until_closed(tolerant.port, PINGING_CLIENT),
        )
    assert outcomes == [grpc.StatusCode.UNAVAILABLE, None]  # GOAWAY too_many_pings; no GOAWAY


async def test_connections_are_closed_at_their_maximum_age():
    limits = LimitsConfig(max_connection_age_s=0.3, max_connection_age_grace_s=0.3)
    async with bound_server(limits=limits) as running:
        assert await watch_until_closed(running.port) == grpc.StatusCode.UNAVAILABLE


async def test_calls_past_the_stream_limit_wait_for_a_free_stream():
    async with channel_to_server(LimitsConfig(max_concurrent_streams=1)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest())
        await watch.read()  # holds the connection's only stream
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        watch.cancel()
        await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
