"""Errors in OpenAI's envelope, ``{"error": {"message", "type", "param", "code"}}``.

gRPC statuses map to the HTTP statuses of Google's API design guide; a BadRequest field
violation's path (``sampling.temperature``) becomes the OpenAI parameter (``temperature``), in
``param`` and in the message (see ``param_names``). A NOT_FOUND naming ``model`` is OpenAI's
``model_not_found``, with the server's words (what it serves).
"""

from __future__ import annotations

import json
import math
import re

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from llmrpc.clients import LlmrpcError
from llmrpc.gateway.param_names import (
    COMPLETION_PARAMS,
    SECTIONS,
    location_param,
    most_telling,
    param_of,
)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# The 4xx statuses with a type of their own; any other 4xx (400, 405, 408, 413, 431...) is the
# caller's request at fault, "invalid_request_error" as OpenAI types it; 5xx are "server_error".
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    if 400 <= status < 500:
        return _ERROR_TYPES.get(status, "invalid_request_error")
    return "server_error"


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status answering a gRPC status (500 for those not listed)."""
    return _HTTP_STATUS.get(code, 500)


class OpenAIError(HTTPException):
    """An error answered in OpenAI's envelope with this HTTP status. An HTTPException, so
    FastAPI passes it on as it is when it comes from reading the body (``json_body``)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, headers)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.retry_after is not None:
            headers["retry-after"] = str(math.ceil(self.retry_after))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse_event(self) -> bytes:
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready; nobody reads the reply."""


def invalid(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_argument")


def from_grpc(error: LlmrpcError, names: dict[str, str | None] | None = None) -> OpenAIError:
    """The OpenAI error for a failed gRPC call; ``names`` maps its field paths to the endpoint's
    parameters (``param_names.COMPLETION_PARAMS`` when not given)."""
    violations = error.field_violations
    if error.code == grpc.StatusCode.NOT_FOUND and violations and violations[0].field == "model":
        # OpenAI's shape; the server's description names what it serves
        return OpenAIError(404, violations[0].description, "model", "model_not_found")
    param = param_of(violations[0].field, names) if violations else None
    message = error.message
    if violations:
        message = _in_callers_terms(message, violations[0], param, names or COMPLETION_PARAMS)
    status = _HTTP_STATUS.get(error.code, 500)
    return OpenAIError(status, message, param, error.code_name.lower(), error.details.retry_delay)


def _in_callers_terms(
    message: str, violation, param: str | None, names: dict[str, str | None]
) -> str:
    """The message with the gRPC field path it starts with replaced by the caller's parameter
    (or dropped: a field the caller did not send, which no parameter names), and other fields
    it mentions by the names the caller used (``max_tokens`` is ``max_completion_tokens`` in a
    chat request that sent that)."""
    if violation.description not in message:
        message = f"{message}: {violation.description}"
    prefix = f"{violation.field}: "
    if not message.startswith(prefix):
        return message
    rest = message[len(prefix) :]
    for field, name in names.items():
        section, _, short = field.rpartition(".")
        if section in SECTIONS and name is not None and name != short:
            rest = re.sub(rf"(?<![\w.]){re.escape(short)}\b", name, rest)
    return rest if param is None else f"{param}: {rest}"


def validation_failed(errors: list[dict]) -> OpenAIError:
    """The 400 for a body that failed validation: its most telling error, by parameter."""
    worst = most_telling(errors or [{}])
    param = location_param(tuple(worst.get("loc", ())))
    message = worst.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    return invalid(param, message)


async def _on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return validation_failed(list(error.errors())).response()


async def _on_http_error(request: Request, error: HTTPException) -> JSONResponse:
    """A status Starlette or FastAPI answered itself: an unknown route, a wrong method..."""
    headers = dict(error.headers or {})
    where = f"{request.method} {request.url.path}"
    if error.status_code == 404 and error.detail == "Not Found":
        message = f"{where}: no such route"
    elif error.status_code == 405:
        allowed = headers.get("Allow") or headers.get("allow") or ""
        message = f"{where}: method not allowed (allowed: {allowed})"
    else:
        message = str(error.detail)
    return OpenAIError(error.status_code, message, headers=headers).response()


async def _on_openai_error(request: Request, error: OpenAIError) -> JSONResponse:
    return error.response()


async def _on_client_gone(request: Request, error: ClientGone) -> Response:
    return Response(status_code=499)  # logged by uvicorn's access log only: not a fault


async def _on_grpc_error(request: Request, error: LlmrpcError) -> JSONResponse:
    return from_grpc(error).response()


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(LlmrpcError, _on_grpc_error)
    app.add_exception_handler(ClientGone, _on_client_gone)
