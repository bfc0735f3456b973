"""vLLM's LoRA routes: ``POST /v1/load_lora_adapter`` ({"lora_name", "lora_path"}) and
``POST /v1/unload_lora_adapter`` ({"lora_name"}, and vLLM's optional "lora_int_id"), over
AdminService's LoadLoraAdapter and UnloadLoraAdapter, on every serving replica (requests may go
to any of them).

An unload goes by ``lora_name`` alone, as vLLM's does: vLLM accepts ``lora_int_id`` and does not
use it. Here too it is checked (a 32-bit integer) and not used: this API gives adapters no integer
id (the engine's internal one differs between replicas), so there is nothing to compare it with.

They answer as vLLM does: 200 with a plain-text "Success: ..." line. Errors are OpenAI error
objects from the gRPC status: 400 naming the field (a bad folder, a rank over --max-lora-rank,
a server without --enable-lora, and, with vLLM's status, a name in use: gRPC's ALREADY_EXISTS,
its code "already_exists"), 404 (unload of an adapter not loaded).
Like every other route, the caller's key reaches the server, which lets only an admin key
(``--admin-api-key``, when set) change adapters.
"""

from __future__ import annotations

import asyncio

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from llmrpc.clients import LlmrpcError
from llmrpc.gateway.errors import OpenAIError, from_grpc
from llmrpc.gateway.json_body import JsonRoute
from llmrpc.gateway.openai_models import Int32, StrictModel
from llmrpc.gateway.openapi_docs import ERRORS, ErrorResponse
from llmrpc.gateway.state import gateway_of

router = APIRouter(route_class=JsonRoute, responses=ERRORS)
# The success answer is vLLM's plain-text line; errors stay JSON (OpenAI's envelope), so the
# route keeps the JSON response class and documents its 200 as text.
_SUCCESS = {
    200: {
        "description": "vLLM's success line.",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}
_BAD_LOAD = {
    "model": ErrorResponse,
    "description": "A bad body or folder, a rank over --max-lora-rank, LoRA off, or a name "
    "already loaded (vLLM's status for it; code already_exists).",
}
_LOAD_ANSWERS = {**_SUCCESS, 400: _BAD_LOAD}
_UNLOAD_ANSWERS = {
    **_SUCCESS,
    400: {"model": ErrorResponse, "description": "A bad body, or LoRA off."},
    404: {"model": ErrorResponse, "description": "No adapter of that name is loaded."},
}

# gRPC field paths -> the body's fields (the same names)
LORA_PARAMS: dict[str, str | None] = {
    "lora_name": "lora_name",
    "lora_path": "lora_path",
    "engine": None,  # FAILED_PRECONDITION (LoRA off) names no field of the body
}


class LoadLoraAdapterBody(StrictModel):
    lora_name: str
    lora_path: str
    base_model_name: str = ""  # ours: the served model it adapts (default: the default model)


class UnloadLoraAdapterBody(StrictModel):
    lora_name: str
    lora_int_id: Int32 | None = Field(
        default=None,
        description="Accepted as vLLM accepts it, and not used: the adapter unloaded is the one "
        "lora_name names (vLLM's rule too).",
    )


async def _on_every_replica(request: Request, method: str, *args, **kwargs) -> None:
    serving = gateway_of(request).pool.serving
    try:
        if not serving:  # UNAVAILABLE, as any call to no replica
            await gateway_of(request).pool.call(method, *args, **kwargs)
        await asyncio.gather(*(getattr(b.client, method)(*args, **kwargs) for b in serving))
    except LlmrpcError as error:
        raise _openai_error(error) from None


def _openai_error(error: LlmrpcError) -> OpenAIError:
    """The gRPC status as OpenAI's error; a name in use is vLLM's 400 on these routes (gRPC's
    ALREADY_EXISTS is a 409 elsewhere), naming lora_name."""
    answer = from_grpc(error, LORA_PARAMS)
    if error.code != grpc.StatusCode.ALREADY_EXISTS:
        return answer
    return OpenAIError(400, answer.message, "lora_name", answer.code)


@router.post("/v1/load_lora_adapter", response_model=None, responses=_LOAD_ANSWERS)
async def load_lora_adapter(body: LoadLoraAdapterBody, request: Request) -> PlainTextResponse:
    await _on_every_replica(
        request,
        "load_lora_adapter",
        body.lora_name,
        body.lora_path,
        base_model_name=body.base_model_name,
    )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_model=None, responses=_UNLOAD_ANSWERS)
async def unload_lora_adapter(body: UnloadLoraAdapterBody, request: Request) -> PlainTextResponse:
    await _on_every_replica(request, "unload_lora_adapter", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
