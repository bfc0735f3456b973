"""Retries: UNAVAILABLE only, with backoff, never past the deadline, never once a stream has
yielded. A scripted servicer fails a set number of times; the retry logic is what is tested."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
from client_utils import Caller
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from llmrpc.clients import AsyncClient, Client, LlmrpcError, RetryPolicy
from llmrpc.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

FAST_RETRIES = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.01)


class Script:
    """How many calls fail, and with which code, before calls succeed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.failures = 0
        self.code = grpc.StatusCode.UNAVAILABLE
        self.attempts = 0
        self.retry_delay: float | None = None

    def next_attempt(self, context: grpc.ServicerContext) -> None:
        self.attempts += 1
        if self.attempts <= self.failures:
            context.abort_with_status(self._status())

    def _status(self) -> grpc.Status:
        status = status_pb2.Status(code=self.code.value[0], message="scripted failure")
        if self.retry_delay is not None:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(int(self.retry_delay * 1000))
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return rpc_status.to_status(status)


class ScriptedAdmin(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, script: Script) -> None:
        self.script = script

    def ListModels(self, request, context):
        self.script.next_attempt(context)
        return admin_pb2.ListModelsResponse(models=[admin_pb2.Model(id="m")])


class ScriptedGeneration(generation_pb2_grpc.GenerationServiceServicer):
    """GenerateStream: fails before any message as scripted; with ``fail_after_first`` set,
    sends one message and then fails with UNAVAILABLE."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.fail_after_first = False

    def GenerateStream(self, request, context):
        self.script.next_attempt(context)
        yield generation_pb2.GenerateResponse(request_id="r", text="a", token_ids=[1])
        if self.fail_after_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "lost after the first message")
        last = generation_pb2.FINISH_REASON_LENGTH
        yield generation_pb2.GenerateResponse(request_id="r", text="b", finish_reason=last)


@pytest.fixture(scope="module")
def scripted_server():
    script = Script()
    generation = ScriptedGeneration(script)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    admin_pb2_grpc.add_AdminServiceServicer_to_server(ScriptedAdmin(script), server)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(generation, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", script, generation
    server.stop(grace=None)


@pytest.fixture(params=["sync", "async"])
async def scripted(request, scripted_server):
    address, script, generation = scripted_server
    script.reset()
    generation.fail_after_first = False
    client_class = AsyncClient if request.param == "async" else Client
    caller = Caller(client_class(address, retry=FAST_RETRIES))
    yield caller, script, generation
    await caller.close()


async def test_unavailable_is_retried_until_it_succeeds(scripted):
    call, script, _ = scripted
    script.failures = 3
    models = await call("models")
    assert [m.id for m in models] == ["m"]
    assert script.attempts == 4


async def test_retries_stop_after_max_attempts(scripted):
    call, script, _ = scripted
    script.failures = 10
    with pytest.raises(LlmrpcError) as caught:
        await call("models")
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert script.attempts == FAST_RETRIES.max_attempts


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
    ],
)
async def test_other_codes_are_never_retried(scripted, code):
    call, script, _ = scripted
    script.failures, script.code = 1, code
    with pytest.raises(LlmrpcError) as caught:
        await call("models")
    assert caught.value.code is code
    assert script.attempts == 1


async def test_a_stream_is_retried_before_its_first_message(scripted):
    call, script, _ = scripted
    script.failures = 2
    deltas = await call.collect("stream", "x")
    assert "".join(d.text for d in deltas) == "ab"
    assert script.attempts == 3


async def test_a_stream_that_yielded_is_not_retried(scripted):
    call, script, generation = scripted
    generation.fail_after_first = True
    received = []

    def consume_sync():
        for delta in call.client.stream("x"):
            received.append(delta.text)

    async def consume_async():
        async for delta in call.client.stream("x"):
            received.append(delta.text)

    with pytest.raises(LlmrpcError) as caught:
        await (consume_async() if call.is_async else asyncio.to_thread(consume_sync))
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert received == ["a"]
    assert script.attempts == 1


async def test_the_servers_retry_delay_is_decoded(scripted):
    call, script, _ = scripted
    script.failures, script.code, script.retry_delay = 1, grpc.StatusCode.RESOURCE_EXHAUSTED, 1.5
    with pytest.raises(LlmrpcError) as caught:
        await call("models")
    assert caught.value.details.retry_delay == 1.5


async def test_no_retry_outlives_the_deadline(scripted):
    call, script, _ = scripted
    script.failures = 1000
    # Up to 1000 tries 50 ms apart would take far longer than the 0.5 s deadline allows.
    retry = RetryPolicy(max_attempts=1000, initial_backoff=0.05, max_backoff=0.05)
    patient = Caller(type(call.client)(call.client.target, retry=retry))
    try:
        with pytest.raises(LlmrpcError) as caught:
            await patient("models", timeout=0.5)
    finally:
        await patient.close()
    # The last failure, or the deadline itself when the last attempt (given the time left) was
    # still in flight as it passed: on a busy machine either comes first. Never a retry past it.
    assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert 1 <= script.attempts < 1000


def test_backoff_grows_exponentially_within_the_jitter_ceiling():
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0)
    for attempt, ceiling in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)):
        delays = [policy.backoff(attempt) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling / 2  # jitter spreads over the range, not stuck at zero
    assert policy.backoff(3, server_delay=2.5) == 2.5
