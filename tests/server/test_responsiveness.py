"""Work that grows with a request's size never runs on the event loop, and requests cannot bring
their own chat template (a program) unless the server trusts them to.

Health checks are the canary: each has a 1 s deadline while a multi-megabyte prompt is
tokenized or a slow template renders; tokenizing such a prompt takes several seconds here.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import field_violations, tiny_engine_config

from llmrpc.server.app import start_server
from llmrpc.server.chat_render import REQUEST_TEMPLATE_TIME_S
from llmrpc.server.settings import FrontendConfig
from llmrpc.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    tokenization_pb2,
    tokenization_pb2_grpc,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(tiny_llama_dir):
    """(a server that refuses request templates, one that trusts them)."""
    config = tiny_engine_config(tiny_llama_dir)
    started = []
    for trusted in (False, True):
        frontend = FrontendConfig(
            host="127.0.0.1", grpc_port=0, trust_request_chat_template=trusted
        )
        started.append(await start_server(config, frontend=frontend))
    yield started
    for running in started:
        await running.stop(grace=0)


async def probe_health(channel, until: asyncio.Future) -> int:
    """Health checks, each with a 1 s deadline, until ``until`` is done; returns how many."""
    stub = health_pb2_grpc.HealthStub(channel)
    count = 0
    while not until.done():
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        count += 1
        await asyncio.sleep(0.05)
    return count


def chat(template: str | None = None) -> common_pb2.Chat:
    chat = common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    if template is not None:
        chat.chat_template = template
    return chat


async def test_health_answers_while_a_huge_prompt_is_tokenized(servers):
    running = servers[0]
    options = [("grpc.max_receive_message_length", 64 * 2**20)]  # 600,000 ids and strings
    async with grpc.aio.insecure_channel(running.address, options=options) as channel:
        # Tokenize takes any length (Generate refuses what cannot fit by its length: below)
        tokenize = tokenization_pb2_grpc.TokenizationServiceStub(channel)
        text = "The quick brown fox jumps over the lazy dog. " * 60_000  # 2.7 MB
        started = time.monotonic()
        call = asyncio.ensure_future(tokenize.Tokenize(tokenization_pb2.TokenizeRequest(text=text)))
        probes = await probe_health(channel, call)
        assert (await call).count > 500_000
        # Enough probes to show the loop was free during the tokenization, not only after it.
        assert probes >= (time.monotonic() - started) / 0.5


async def test_a_prompt_the_context_cannot_hold_is_refused_by_its_length(servers):
    """Before tokenizing: 10 MB took 10 s to refuse, and +111 MB of the server's memory."""
    running = servers[0]
    text = "The quick brown fox jumps over the lazy dog. " * (10_000_000 // 45)
    message = common_pb2.ChatMessage(role="user", content=text)
    requests = {
        "text": generation_pb2.GenerateRequest(text=text),
        "chat": generation_pb2.GenerateRequest(chat=common_pb2.Chat(messages=[message])),
    }
    async with grpc.aio.insecure_channel(running.address) as channel:
        generation = generation_pb2_grpc.GenerationServiceStub(channel)
        for field, request in requests.items():
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await generation.Generate(request)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field_violations(failure.value) == [field]
            assert "characters, more than the model's context length" in failure.value.details()
        # A prompt cut to its last tokens is tokenized whole, then cut, as before.
        cut = generation_pb2.GenerateRequest(text=text[:200_000], truncate_prompt_tokens=8)
        cut.stopping.max_tokens = 2
        reply = await generation.Generate(cut)
        assert reply.usage.prompt_tokens == 8


async def test_request_templates_are_refused_unless_trusted(servers):
    refusing, _ = servers
    async with grpc.aio.insecure_channel(refusing.address) as channel:
        generation = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(chat=chat("{{ 'x' }}"))
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await generation.Generate(request)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(failure.value) == ["chat.chat_template"]
        assert "--trust-request-chat-template" in failure.value.details()
        tokenize = tokenization_pb2_grpc.TokenizationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await tokenize.Tokenize(tokenization_pb2.TokenizeRequest(chat=chat("{{ 'x' }}")))
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The model's own template still renders.
        reply = await tokenize.Tokenize(tokenization_pb2.TokenizeRequest(chat=chat()))
        assert reply.count > 0


async def test_a_trusted_template_is_stopped_when_slow_and_health_answers(servers):
    _, trusting = servers
    async with grpc.aio.insecure_channel(trusting.address) as channel:
        tokenize = tokenization_pb2_grpc.TokenizationServiceStub(channel)
        reply = await tokenize.Tokenize(
            tokenization_pb2.TokenizeRequest(chat=chat("[{{ messages[0].content }}]"))
        )
        assert reply.count > 0
        call = asyncio.ensure_future(
            tokenize.Tokenize(tokenization_pb2.TokenizeRequest(chat=chat(SLOW_TEMPLATE)))
        )
        assert await probe_health(channel, call) > 0
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await call
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(failure.value) == ["chat.chat_template"]
        assert f"longer than {REQUEST_TEMPLATE_TIME_S:g} s" in failure.value.details()


async def test_a_trusted_template_output_is_bounded(servers):
    _, trusting = servers
    async with grpc.aio.insecure_channel(trusting.address) as channel:
        tokenize = tokenization_pb2_grpc.TokenizationServiceStub(channel)
        big = "{% for i in range(100000) %}" + "x" * 100 + "{% endfor %}"  # 10 MB of text
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await tokenize.Tokenize(tokenization_pb2.TokenizeRequest(chat=chat(big)))
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(failure.value) == ["chat.chat_template"]
        assert "characters" in failure.value.details()
