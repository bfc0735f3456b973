"""Errors in OpenAI's envelope, ``{"error": {"message", "type", "param", "code"}}``.

gRPC statuses map to the HTTP statuses of Google's API design guide; a BadRequest field
violation's path (``sampling.temperature``) becomes the OpenAI parameter (``temperature``), in
``param`` and in the message (see ``param_names``).
"""

from __future__ import annotations

import json
import math

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from llmrpc.clients import LlmrpcError
from llmrpc.gateway.param_names import location_param, most_telling, param_of

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

_ERROR_TYPES = {
    400: "invalid_request_error",
    408: "invalid_request_error",  # the body arrived too slowly
    413: "invalid_request_error",  # the body is too large
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
}


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
    ) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        error_type = _ERROR_TYPES.get(self.status, "server_error")
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {}
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
    param = param_of(violations[0].field, names) if violations else None
    message = error.message
    if violations and violations[0].description not in message:
        message = f"{message}: {violations[0].description}"
    if param is not None and message.startswith(f"{violations[0].field}: "):
        message = param + message[len(violations[0].field) :]  # the caller's name, not ours
    status = _HTTP_STATUS.get(error.code, 500)
    return OpenAIError(status, message, param, error.code_name.lower(), error.details.retry_delay)


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
    return OpenAIError(error.status_code, str(error.detail)).response()


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
