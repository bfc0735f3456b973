"""``POST /v1/embeddings`` (OpenAI's), ``/v1/score`` and ``/v1/rerank`` (vLLM's), over the gRPC
``EmbeddingService.Embed``.

Score and rerank are the cosine similarity of embeddings (as vLLM serves them for embedding
models); cross-encoders are not supported yet. An input the server cannot embed fails the
request with a 400 naming it (``input[2]``), as OpenAI answers; the gRPC API itself reports it
per input.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from llmrpc.clients import LlmrpcError
from llmrpc.clients.embedding import Embeddings
from llmrpc.gateway import fanout
from llmrpc.gateway.errors import OpenAIError, from_grpc
from llmrpc.gateway.json_body import JsonRoute
from llmrpc.gateway.openai_models import Prompt, StrictModel, UInt32, refused
from llmrpc.gateway.openapi_docs import ERRORS, answer
from llmrpc.gateway.state import gateway_of, request_id

router = APIRouter(route_class=JsonRoute, responses=ERRORS)

MAX_INPUTS = 2048  # as the gRPC API (EmbedRequest.inputs) and OpenAI
Positive = Annotated[int, Field(ge=1, le=2**32 - 1)]
_SPECIAL_TOKENS = (
    "text inputs always get the tokenizer's special tokens (as BERT's [CLS] and [SEP])"
)


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Positive | None = None
    user: str | None = None  # for the caller's records; changes nothing
    truncate_prompt_tokens: Positive | None = None  # vLLM: keep the last N tokens
    normalize: bool | None = None  # vLLM: unset, the model's default
    add_special_tokens: Annotated[bool | None, refused(_SPECIAL_TOKENS, True)] = None


class ScoreRequest(StrictModel):
    model: str | None = None
    text_1: str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
    text_2: str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
    truncate_prompt_tokens: Positive | None = None
    user: str | None = None


class RerankRequest(StrictModel):
    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS - 1)]
    top_n: UInt32 = 0  # 0: every document
    truncate_prompt_tokens: Positive | None = None
    user: str | None = None


# --- the answers' schemas (OpenAPI docs) -------------------------------------------------------


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"]
    embedding: list[float] | str  # a string with encoding_format base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreList(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# --- routes -------------------------------------------------------------------------------------


@router.post("/v1/embeddings", responses=answer(EmbeddingList))
async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict:
    single = isinstance(body.input, str) or (body.input and isinstance(body.input[0], int))
    inputs = [body.input] if single else list(body.input)
    if not inputs:
        raise OpenAIError(400, "input: must not be empty", "input", "invalid_argument")
    fanout.check_prompts(gateway_of(request).api, len(inputs), "input")
    rid = request_id(request)
    names = ["input"] if single else [f"input[{i}]" for i in range(len(inputs))]
    options = {"dimensions": body.dimensions, "normalize": body.normalize}
    result = await _embed(request, body, inputs, names, rid, **options)
    vectors = [r.embedding for r in result.results]
    data = [
        {"index": i, "object": "embedding", "embedding": _encoded(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    return _listing(f"embd-{rid}", result, data)


@router.post("/v1/score", responses=answer(ScoreList))
@router.post("/score", responses=answer(ScoreList))  # vLLM serves both
async def create_score(body: ScoreRequest, request: Request) -> dict:
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(firsts) != 1 and len(firsts) != len(seconds):
        message = f"text_1: one text, or as many as text_2 ({len(seconds)}); got {len(firsts)}"
        raise OpenAIError(400, message, "text_1", "invalid_argument")
    names = _names("text_1", body.text_1) + _names("text_2", body.text_2)
    rid = request_id(request)
    result = await _embed(request, body, firsts + seconds, names, rid)
    vectors = _unit_rows([r.embedding for r in result.results])
    left, right = vectors[: len(firsts)], vectors[len(firsts) :]
    scores = (left * right).sum(axis=1)  # cosine: rows are unit vectors; one text broadcasts
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return _listing(f"score-{rid}", result, data)


@router.post("/v1/rerank", responses=answer(RerankResponse))
@router.post("/rerank", responses=answer(RerankResponse))  # vLLM's aliases (Jina, Cohere v2)
@router.post("/v2/rerank", responses=answer(RerankResponse))
async def create_rerank(body: RerankRequest, request: Request) -> dict:
    names = ["query"] + [f"documents[{i}]" for i in range(len(body.documents))]
    rid = request_id(request)
    result = await _embed(request, body, [body.query, *body.documents], names, rid)
    vectors = _unit_rows([r.embedding for r in result.results])
    scores = vectors[1:] @ vectors[0]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = [
        {
            "index": i,
            "document": {"text": body.documents[i]},
            "relevance_score": float(scores[i]),
        }
        for i in order
    ]
    usage = {"total_tokens": result.prompt_tokens}
    return {"id": f"rerank-{rid}", "model": result.model, "usage": usage, "results": results}


# --- helpers ------------------------------------------------------------------------------------


async def _embed(request: Request, body, inputs, names: list[str], rid: str, **options):
    """The gRPC Embed of ``inputs``; its failure, or an input's, as an OpenAI error naming
    ``names[i]`` (the request's own parameter for input ``i``; the inputs as a whole are the
    first name's parameter)."""
    gateway = gateway_of(request)
    try:
        result: Embeddings = await gateway.pool.call(
            "embed",
            inputs,
            model=body.model or "",
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            request_id=rid,
            **options,
        )
    except LlmrpcError as error:
        raise from_grpc(error, {"inputs": names[0].partition("[")[0]}) from None
    for item in result.results:
        if item.error is not None:
            raise _input_error(item.error, names[item.index])
    return result


def _input_error(error: LlmrpcError, name: str) -> OpenAIError:
    violations = error.field_violations
    description = violations[0].description if violations else error.message
    converted = from_grpc(error, {})
    return OpenAIError(converted.status, f"{name}: {description}", name, converted.code)


def _names(param: str, value) -> list[str]:
    return [param] if isinstance(value, str) else [f"{param}[{i}]" for i in range(len(value))]


def _unit_rows(vectors: list[list[float]]) -> np.ndarray:
    rows = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms == 0, 1, norms)


def _encoded(vector: list[float], encoding_format: str):
    if encoding_format == "float":
        return vector
    # as OpenAI: the little-endian float32 bytes, base64
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _listing(response_id: str, result: Embeddings, data: list[dict]) -> dict:
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": result.model,
        "data": data,
        "usage": usage,
    }
