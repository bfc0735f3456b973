"""What the OpenAPI schema (``/openapi.json``) says of responses, so clients and schema-driven
tests (``tests/gateway/test_schemathesis.py``) can rely on it: every error, 4xx or 5xx, is
OpenAI's envelope (never FastAPI's 422 ``detail``), and generation answers JSON or, when
streamed, server-sent events.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None
    stop_reason: str | int | None
    prompt_logprobs: list[dict | None] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallOut(BaseModel):
    id: str
    type: str
    function: dict  # {"name": ..., "arguments": JSON object text}


class ChatMessageOut(BaseModel):
    role: str
    content: str | None  # null when the answer is tool calls alone
    tool_calls: list[ToolCallOut] | None = None  # chat requests with tools
    reasoning_content: str | None = None  # under the server's --reasoning-parser
    reasoning: str | None = None  # the same, under vLLM's current name


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict | None
    finish_reason: str | None
    stop_reason: str | int | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """OpenAI's Response (``/v1/responses``): output items are messages, reasoning and
    function calls; the request's parameters are echoed beside them."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: dict | None
    incomplete_details: dict | None
    model: str
    output: list[dict]
    usage: ResponseUsage | None
    model_config = {"extra": "allow"}


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Tokens(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Text(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


# Every route: errors in the envelope. A "4XX" entry also keeps FastAPI from documenting 422.
ERRORS: dict = {
    "4XX": {"model": ErrorResponse, "description": "The request is wrong (OpenAI's envelope)."},
    "5XX": {"model": ErrorResponse, "description": "The server cannot answer now."},
}

# One server-sent event (as schema-driven clients read an event stream): data only, each a
# chunk's JSON, the last "[DONE]".
SSE_EVENT: dict = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"const": "message"}, "data": {"type": "string"}},
    "additionalProperties": False,
}


def generation(model: type[BaseModel]) -> dict:
    """A generation route's answer: ``model`` as JSON, or with "stream": true an event stream."""
    return {
        200: {
            "model": model,
            "description": "The whole answer, or with stream: true server-sent events.",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        },
    }


# A Responses API stream: typed events, no "[DONE]".
RESPONSE_EVENT: dict = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "additionalProperties": False,
}


def response_events(model: type[BaseModel]) -> dict:
    """``/v1/responses``: ``model`` as JSON, or with "stream": true typed events."""
    return {
        200: {
            "model": model,
            "description": "The response, or with stream: true its server-sent events.",
            "content": {"text/event-stream": {"schema": RESPONSE_EVENT}},
        },
    }


def answer(model: type[BaseModel]) -> dict:
    return {200: {"model": model, "description": "The answer."}}


# Probes: a status, no body.
PROBE: dict = {
    200: {"description": "At least one gRPC replica serves.", "content": {}},
    503: {"description": "No gRPC replica serves.", "content": {}},
}
