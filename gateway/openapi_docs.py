"""What the OpenAPI schema (``/openapi.json``) says of responses, so clients and schema-driven
tests (``tests/gateway/test_schemathesis.py``) can rely on it: every error, 4xx or 5xx, is
OpenAI's envelope (never FastAPI's 422 ``detail``), and generation answers JSON or, when
streamed, server-sent events.
"""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorDetail


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

# Generation routes: a JSON body, or with "stream": true an event stream.
GENERATION: dict = {
    200: {
        "description": "The whole answer, or with stream: true server-sent events.",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    },
}

# Probes: a status, no body.
PROBE: dict = {
    200: {"description": "At least one gRPC replica serves.", "content": {}},
    503: {"description": "No gRPC replica serves.", "content": {}},
}
