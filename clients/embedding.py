"""``embed``'s request and result: EmbeddingService.Embed in Python types.

One result per input, in input order; an input the server could not embed carries its own
``LlmrpcError`` (``error``) instead of a vector, and the others are unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from llmrpc.clients.errors import LlmrpcError, decode_details
from llmrpc.v1 import common_pb2, embedding_pb2

EmbedInput = str | Sequence[int]  # text, or token ids


@dataclass(frozen=True)
class EmbedResult:
    index: int  # the input's position
    embedding: list[float]  # empty when error is set
    num_prompt_tokens: int
    error: LlmrpcError | None = None


@dataclass(frozen=True)
class Embeddings:
    """``embed``'s result."""

    results: list[EmbedResult]
    prompt_tokens: int  # of the inputs embedded
    model: str


def embed_request(
    inputs: Sequence[EmbedInput],
    *,
    model: str,
    dimensions: int | None = None,
    truncate_prompt_tokens: int | None = None,
    normalize: bool | None = None,
) -> embedding_pb2.EmbedRequest:
    request = embedding_pb2.EmbedRequest(model=model)
    for item in inputs:
        if isinstance(item, str):
            request.inputs.add(text=item)
        else:
            request.inputs.add(token_ids=common_pb2.TokenIds(ids=list(item)))
    for name, value in (
        ("dimensions", dimensions),
        ("truncate_prompt_tokens", truncate_prompt_tokens),
        ("normalize", normalize),
    ):
        if value is not None:
            setattr(request, name, value)
    return request


def embeddings_from_proto(response: embedding_pb2.EmbedResponse) -> Embeddings:
    return Embeddings(
        results=[_result(r) for r in response.results],
        prompt_tokens=response.usage.prompt_tokens,
        model=response.model,
    )


def _result(result: embedding_pb2.EmbedResult) -> EmbedResult:
    error = None
    if result.HasField("error"):
        status = result.error
        code = next((c for c in grpc.StatusCode if c.value[0] == status.code), None)
        details = decode_details(tuple(status.details))
        error = LlmrpcError(code or grpc.StatusCode.UNKNOWN, status.message, details)
    return EmbedResult(result.index, list(result.embedding), result.num_prompt_tokens, error)
