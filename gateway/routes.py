"""The routes besides generation: models, tokenization, health, version, metrics, load, and
tokenizer information."""

from __future__ import annotations

import asyncio
import importlib.metadata
import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from llmrpc.clients import LlmrpcError
from llmrpc.gateway.errors import OpenAIError, from_grpc
from llmrpc.gateway.json_body import JsonRoute
from llmrpc.gateway.openai_models import DetokenizeRequest, TokenizeBody, TokenizeChat
from llmrpc.gateway.openapi_docs import (
    ERRORS,
    PROBE,
    ModelCard,
    ModelList,
    Text,
    Tokens,
    Version,
    answer,
)
from llmrpc.gateway.params import chat_messages, chat_options
from llmrpc.gateway.state import gateway_of

# DetokenizeRequest field paths -> the parameters of /detokenize.
DETOKENIZE_PARAMS = {"token_ids": "tokens"}

router = APIRouter(route_class=JsonRoute, responses=ERRORS)


def gateway_version() -> str:
    try:
        return importlib.metadata.version("llmrpc")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


def _model_card(card, created: int) -> dict:
    return {
        "id": card.id,
        "object": "model",
        "created": created,
        "owned_by": card.owned_by,
        "root": card.root or card.id,
        "parent": card.parent or None,  # a LoRA adapter's base model, as vLLM lists it
        "max_model_len": card.max_model_len,
    }


@router.get("/v1/models", responses=answer(ModelList))
async def list_models(request: Request) -> dict:
    cards = await gateway_of(request).pool.call("models")
    created = int(time.time())
    return {"object": "list", "data": [_model_card(card, created) for card in cards]}


@router.get("/v1/models/{model:path}", responses=answer(ModelCard))
async def retrieve_model(model: str, request: Request) -> dict:
    for card in await gateway_of(request).pool.call("models"):
        if card.id == model:
            return _model_card(card, int(time.time()))
    raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


@router.post("/tokenize", responses=answer(Tokens))
async def tokenize(body: TokenizeBody, request: Request) -> dict:
    gateway = gateway_of(request)
    kwargs = {"model": body.model or "", "add_special_tokens": body.add_special_tokens}
    if isinstance(body, TokenizeChat):
        kwargs["messages"] = chat_messages(body.messages)
        kwargs["chat_options"] = chat_options(body, gateway.api)
        tokens = await gateway.pool.call("tokenize", **kwargs)
    else:
        tokens = await gateway.pool.call("tokenize", body.prompt, **kwargs)
    reply = {"count": tokens.count, "max_model_len": tokens.max_model_len}
    reply["tokens"] = tokens.token_ids
    reply["token_strs"] = tokens.token_strings if body.return_token_strs else None
    return reply


@router.post("/detokenize", responses=answer(Text))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    pool = gateway_of(request).pool
    try:
        text = await pool.call("detokenize", body.tokens, model=body.model or "")
    except LlmrpcError as error:
        raise from_grpc(error, DETOKENIZE_PARAMS) from None
    return {"prompt": text}


@router.get("/health", response_class=Response, responses=PROBE)
@router.get("/ping", response_class=Response, responses=PROBE)
async def health(request: Request) -> Response:
    """200 while at least one replica's gRPC health says SERVING, else 503: so 503 while a
    replica loads or drains (NOT_SERVING), though a draining one still serves calls."""
    return Response(status_code=200 if gateway_of(request).pool.serving else 503)


@router.get("/version", responses=answer(Version))
async def version() -> dict:
    return {"version": gateway_version()}


async def _load_or_none(backend):
    try:
        return await backend.client.load(timeout=5)
    except LlmrpcError:
        return None


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    gateway = gateway_of(request)
    loads = await asyncio.gather(*(_load_or_none(b) for b in gateway.pool.serving))
    gateway.metrics.set_load([load for load in loads if load is not None])
    return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def server_load(request: Request) -> dict:
    """``GET /load`` (--enable-server-load-tracking): requests in flight on this gateway."""
    return {"server_load": gateway_of(request).server_load}


async def tokenizer_info(request: Request) -> dict:
    """``GET /get_tokenizer_info`` (--enable-tokenizer-info-endpoint)."""
    gateway = gateway_of(request)
    info = await gateway.pool.call("model_info")
    return {
        "model": info.model,
        "vocab_size": info.vocab_size,
        "model_max_length": info.max_model_len,
        "eos_token_ids": info.eos_token_ids,
        "bos_token_id": info.bos_token_id,
        "has_chat_template": info.has_chat_template,
        "chat_template": gateway.api.chat_template,
    }


def add_optional_routes(app, api) -> None:
    if api.enable_server_load_tracking:
        app.add_api_route("/load", server_load, methods=["GET"])
    if api.enable_tokenizer_info_endpoint:
        app.add_api_route("/get_tokenizer_info", tokenizer_info, methods=["GET"])
