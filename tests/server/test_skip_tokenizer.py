"""--skip-tokenizer-init through the API: token ids in and out; text asks are refused clearly."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import pytest_asyncio
from server_utils import field_violations, tiny_engine_config

from llmrpc.server.app import start_server
from llmrpc.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    tokenization_pb2,
    tokenization_pb2_grpc,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(tiny_llama_dir):
    config = tiny_engine_config(tiny_llama_dir)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, skip_tokenizer_init=True)
    )
    running = await start_server(config, host="127.0.0.1", port=0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield channel
    await running.stop(grace=0)


async def test_token_ids_in_token_ids_out(channel):
    request = generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=4, ignore_eos=True),
    )
    response = await generation_pb2_grpc.GenerationServiceStub(channel).Generate(request)
    assert len(response.token_ids) == 4 and response.text == ""


async def test_text_input_is_refused_naming_the_field(channel):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation_pb2_grpc.GenerationServiceStub(channel).Generate(
            generation_pb2.GenerateRequest(text="hello")
        )
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == ["text"]


async def test_tokenize_is_a_failed_precondition(channel):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await tokenization_pb2_grpc.TokenizationServiceStub(channel).Tokenize(
            tokenization_pb2.TokenizeRequest(text="hello")
        )
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
