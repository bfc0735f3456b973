"""EmbeddingService.Embed over a real server with MiniLM (its engine in a process of its own):
vectors as sentence-transformers makes them, per-input errors, the call's own errors, and an
encoder refusing generation."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
import torch
from embedding_models import minilm_dir, sentences
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import field_violations, frontend_config
from torch.nn import functional

from llmrpc.clients import AsyncClient
from llmrpc.engine.config import EngineConfig, ModelConfig
from llmrpc.server.app import RunningServer, start_server
from llmrpc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    embedding_pb2,
    embedding_pb2_grpc,
    generation_pb2,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXTS = sentences(6)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[RunningServer]:
    config = EngineConfig(model=ModelConfig(model=str(minilm_dir()), dtype="float32"))
    running = await start_server(config, frontend=frontend_config("process"))
    yield running
    await running.stop(grace=0)


@pytest.fixture(scope="module")
def embedding(channel) -> embedding_pb2_grpc.EmbeddingServiceStub:
    return embedding_pb2_grpc.EmbeddingServiceStub(channel)


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir())


def text(value: str) -> embedding_pb2.EmbedInput:
    return embedding_pb2.EmbedInput(text=value)


def token_ids(*ids: int) -> embedding_pb2.EmbedInput:
    return embedding_pb2.EmbedInput(token_ids=common_pb2.TokenIds(ids=ids))


def error_fields(status) -> list[str]:
    fields = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        assert detail.Unpack(bad_request)
        fields.extend(v.field for v in bad_request.field_violations)
    return fields


async def test_texts_embed_as_sentence_transformers(embedding, reference):
    response = await embedding.Embed(embedding_pb2.EmbedRequest(inputs=[text(t) for t in TEXTS]))
    assert [r.index for r in response.results] == list(range(len(TEXTS)))
    vectors = torch.tensor([list(r.embedding) for r in response.results])
    assert functional.cosine_similarity(vectors, reference, dim=1).min() >= 0.9999
    assert response.model == str(minilm_dir())
    assert response.usage.prompt_tokens == sum(r.num_prompt_tokens for r in response.results)


async def test_one_bad_input_fails_alone(embedding, reference):
    inputs = [
        text(TEXTS[0]),
        token_ids(101, 999_999, 102),  # outside the vocabulary
        token_ids(),  # nothing to embed
        token_ids(*([1037] * 600)),  # longer than BERT's 512 positions
        embedding_pb2.EmbedInput(),  # neither text nor token ids
        text(TEXTS[1]),
    ]
    response = await embedding.Embed(embedding_pb2.EmbedRequest(inputs=inputs))
    failed = {r.index: r.error for r in response.results if r.HasField("error")}
    assert sorted(failed) == [1, 2, 3, 4]
    assert all(s.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for s in failed.values())
    assert [error_fields(failed[i]) for i in (1, 2, 3)] == [
        [f"inputs[{i}].token_ids"] for i in (1, 2, 3)
    ]
    assert error_fields(failed[4]) == ["inputs[4]"]
    good = torch.tensor([list(response.results[i].embedding) for i in (0, 5)])
    assert functional.cosine_similarity(good, reference[:2], dim=1).min() >= 0.9999
    assert response.usage.prompt_tokens == response.results[0].num_prompt_tokens + (
        response.results[5].num_prompt_tokens
    )


async def test_dimensions_normalize_and_truncation(embedding, tokenizer):
    request = embedding_pb2.EmbedRequest(
        inputs=[text(TEXTS[2])], dimensions=64, truncate_prompt_tokens=5
    )
    (result,) = (await embedding.Embed(request)).results
    assert len(result.embedding) == 64 and result.num_prompt_tokens == 5
    assert abs(torch.tensor(list(result.embedding)).norm() - 1) < 1e-5
    # a text keeps its special tokens and its last tokens, as vLLM truncates: [CLS] ... [SEP]
    ids = tokenizer.encode(TEXTS[2])
    kept = token_ids(ids[0], *ids[-4:])
    same = embedding_pb2.EmbedRequest(inputs=[kept], dimensions=64)
    (expected,) = (await embedding.Embed(same)).results
    assert list(result.embedding) == pytest.approx(list(expected.embedding), abs=1e-6)
    raw = embedding_pb2.EmbedRequest(inputs=[text(TEXTS[2])], normalize=False)
    (result,) = (await embedding.Embed(raw)).results
    assert abs(torch.tensor(list(result.embedding)).norm() - 1) > 1e-2


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"inputs": [text("a")], "dimensions": 385}, "dimensions"),
        ({"inputs": [text("a")], "dimensions": 0}, "dimensions"),
        ({"inputs": [text("a")], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({}, "inputs"),
        ({"inputs": [text("a")] * 2049}, "inputs"),
    ],
    ids=["dimensions-too-many", "dimensions-zero", "truncate-zero", "no-inputs", "2049-inputs"],
)
async def test_bad_calls_name_their_field(embedding, fields, field):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await embedding.Embed(embedding_pb2.EmbedRequest(**fields))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(error.value) == [field]


async def test_a_queued_embed_that_cannot_meet_its_deadline_is_dropped_uncomputed(channel):
    """As for generation: the call's deadline reaches the engine, which drops a queued request
    that cannot start in time at its recent pace, before computing it; the call ends
    DEADLINE_EXCEEDED from the server (its own message), not from the deadline passing."""
    embedding = embedding_pb2_grpc.EmbeddingServiceStub(channel)
    admin = admin_pb2_grpc.AdminServiceStub(channel)

    def distinct_inputs(count: int, first: int) -> list[embedding_pb2.EmbedInput]:
        return [
            token_ids(*(first + (7 * i + j) % 20_000 for j in range(250))) for i in range(count)
        ]

    await embedding.Embed(embedding_pb2.EmbedRequest(inputs=distinct_inputs(4, 1000)))  # the pace
    # 125k tokens queued ahead: far more than the engine computes in 5 s on any CPU.
    busy = embedding.Embed(embedding_pb2.EmbedRequest(inputs=distinct_inputs(500, 2000)))
    await wait_until_load(admin, lambda load: load.num_waiting_requests > 400)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await embedding.Embed(embedding_pb2.EmbedRequest(inputs=[token_ids(7592)]), timeout=5)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "dropped from the queue without being computed" in error.value.details()
    busy.cancel()  # its engine requests are aborted
    await wait_until_load(
        admin, lambda load: load.num_waiting_requests + load.num_running_requests == 0
    )


async def wait_until_load(admin, condition, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition(await admin.GetLoad(admin_pb2.GetLoadRequest())):
        assert loop.time() < deadline, "the engine's load never reached the condition"
        await asyncio.sleep(0.05)


async def test_model_info_says_pooling_and_the_embedding_size(channel, server):
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    info = await admin.GetModelInfo(admin_pb2.GetModelInfoRequest())
    assert info.runner == admin_pb2.GetModelInfoResponse.RUNNER_POOLING
    assert info.HasField("embedding_size") and info.embedding_size == 384  # MiniLM's
    async with AsyncClient(f"127.0.0.1:{server.port}") as client:
        facts = await client.model_info()
    assert (facts.runner, facts.embedding_size) == ("pooling", 384)


async def test_unknown_model_is_not_found(embedding):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await embedding.Embed(embedding_pb2.EmbedRequest(model="nope", inputs=[text("a")]))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_an_encoder_refuses_generation(generation):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generation.Generate(generation_pb2.GenerateRequest(text="Hello"))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not generate" in error.value.details()


async def test_health_serves_the_embedding_service(channel):
    health = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="llmrpc.v1.EmbeddingService")
    response = await health.Check(request)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_command_line_client_embeds(server):
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "llmrpc.cli", "embed", TEXTS[0], "--dimensions", "8"),
        *("--target", f"127.0.0.1:{server.port}"),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0
    (line,) = [json.loads(text) for text in out.decode().splitlines()]
    assert line["index"] == 0 and len(line["embedding"]) == 8 and line["num_prompt_tokens"] > 2
