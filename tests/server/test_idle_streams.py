"""Streams that never send their request cost the server nothing lasting: a wrong key is refused
before the message is read, a stream whose message does not come ends at a deadline, a message
that is not the method's protobuf is INVALID_ARGUMENT; connections per listener are capped."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import bound_server

from llmrpc.server.limits import channel_options
from llmrpc.server.settings import LimitsConfig
from llmrpc.v1 import admin_pb2, generation_pb2

GENERATE = "/llmrpc.v1.GenerationService/Generate"
GENERATE_STREAM = "/llmrpc.v1.GenerationService/GenerateStream"
SERVER_INFO = "/llmrpc.v1.AdminService/GetServerInfo"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"  # bidi, keyless


async def _never_sends(stop: asyncio.Event):
    """A request stream that holds its call open and sends nothing."""
    await stop.wait()
    if False:  # an async generator that yields nothing
        yield


@contextlib.asynccontextmanager
async def silent_call(channel: grpc.aio.Channel, method: str, metadata=()):
    """A call of ``method`` whose headers go out at once and whose request never does."""
    stop = asyncio.Event()
    multicallable = channel.stream_stream(method)  # raw bytes both ways
    call = multicallable(_never_sends(stop), metadata=metadata)
    try:
        yield call
    finally:
        stop.set()
        call.cancel()


async def _read_to_the_end(call) -> None:
    async for _ in call:
        pass


async def _code_within(call, seconds: float) -> grpc.StatusCode | None:
    """The status the call ends with, or None if it is still open after ``seconds``."""
    try:
        await asyncio.wait_for(_read_to_the_end(call), seconds)
    except asyncio.TimeoutError:
        return None
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", [GENERATE, GENERATE_STREAM, SERVER_INFO])
async def test_a_wrong_key_is_refused_before_the_request_message_arrives(method):
    async with (
        bound_server(api_key=("k1",)) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        for metadata in ((("authorization", "Bearer wrong"),), ()):
            async with silent_call(channel, method, metadata) as call:
                assert await _code_within(call, 5) == grpc.StatusCode.UNAUTHENTICATED
                assert "API key" in await call.details()


@pytest.mark.parametrize("method", [GENERATE, GENERATE_STREAM, SERVER_INFO, REFLECTION])
async def test_a_request_message_that_never_comes_ends_the_call(method):
    limits = LimitsConfig(request_message_timeout_s=0.5)
    async with (
        bound_server(api_key=("k1",), limits=limits) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        async with silent_call(channel, method, (("authorization", "Bearer k1"),)) as call:
            assert await _code_within(call, 5) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "--grpc-request-message-timeout" in await call.details()
        # a call that sends its message in time is served as before
        info = channel.unary_unary(
            SERVER_INFO, response_deserializer=admin_pb2.GetServerInfoResponse.FromString
        )
        metadata = (("authorization", "Bearer k1"),)
        request = admin_pb2.GetServerInfoRequest().SerializeToString()
        response = await info(request, metadata=metadata)
        assert response.api_version == "v1"


async def test_a_message_that_is_not_the_methods_protobuf_is_invalid_argument():
    async with (
        bound_server(api_key=("k1",)) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        generate = channel.unary_unary(GENERATE)  # raw bytes
        garbage = b"\xff\xff\xff\xff"  # a field tag past the varint's end
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await generate(garbage, metadata=(("authorization", "Bearer k1"),), timeout=5)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert generation_pb2.GenerateRequest.DESCRIPTOR.full_name in failure.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as failure:  # the key first, then the message
            await generate(garbage, metadata=(("authorization", "Bearer no"),), timeout=5)
        assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_health_is_answered_while_calls_wait_for_their_messages():
    async with (
        bound_server() as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
        contextlib.AsyncExitStack() as stack,
    ):
        for _ in range(50):
            await stack.enter_async_context(silent_call(channel, GENERATE))
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no model


def test_the_stream_and_connection_limits_have_defaults():
    options = dict(channel_options(LimitsConfig()))
    assert options["grpc.max_concurrent_streams"] == 256
    assert options["grpc.max_allowed_incoming_connections"] >= 64
    assert options["grpc.server_handshake_timeout_ms"] == 10_000


async def test_connections_past_the_cap_are_refused_and_the_cap_frees_up():
    async with bound_server(limits=LimitsConfig(max_connections=2)) as running:
        address = f"127.0.0.1:{running.port}"
        request = health_pb2.HealthCheckRequest()
        no_pool = (("grpc.use_local_subchannel_pool", 1),)  # one connection per channel
        async with contextlib.AsyncExitStack() as stack:
            held = [
                await stack.enter_async_context(grpc.aio.insecure_channel(address, options=no_pool))
                for _ in range(2)
            ]
            for channel in held:  # connected, and each keeps its connection
                await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
            async with grpc.aio.insecure_channel(address, options=no_pool) as third:
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    await health_pb2_grpc.HealthStub(third).Check(request, timeout=2)
                assert failure.value.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
        async with grpc.aio.insecure_channel(address, options=no_pool) as later:
            # the server frees the places as it sees the closes; the client retries meanwhile
            await health_pb2_grpc.HealthStub(later).Check(request, timeout=20, wait_for_ready=True)


async def test_a_burst_of_calls_on_one_connection_is_served_whole():
    """Past the stream limit calls wait on the client; none is refused (REFUSED_STREAM) or
    cancelled, as gRPC core's stream-allocation counting did to a tenth of such a burst."""
    async with (
        bound_server(api_key=("k1",)) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        info = channel.unary_unary(SERVER_INFO)  # raw bytes
        request = admin_pb2.GetServerInfoRequest().SerializeToString()
        metadata = (("authorization", "Bearer k1"),)
        calls = [info(request, metadata=metadata, timeout=60) for _ in range(2000)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        failures = [o.code() for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        assert failures == []
