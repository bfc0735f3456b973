"""One exception type for every failed call: ``LlmrpcError`` with the gRPC code, message and the
decoded ``google.rpc`` details the server attached (field violations, retry delay, resource).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

REQUEST_ID_METADATA = "x-request-id"


@dataclass(frozen=True)
class FieldViolation:
    """One wrong request field (from ``google.rpc.BadRequest``), e.g. ``sampling.top_p``."""

    field: str
    description: str


@dataclass(frozen=True)
class ResourceInfo:
    """The resource a NOT_FOUND (or similar) error is about (``google.rpc.ResourceInfo``)."""

    resource_type: str
    resource_name: str
    description: str


@dataclass(frozen=True)
class ErrorDetails:
    """The ``google.rpc`` details of a status, decoded; ``raw`` keeps every detail as sent."""

    field_violations: tuple[FieldViolation, ...] = ()
    retry_delay: float | None = None  # seconds, from google.rpc.RetryInfo
    resource: ResourceInfo | None = None
    reason: str | None = None  # google.rpc.ErrorInfo.reason
    raw: tuple[any_pb2.Any, ...] = field(default=(), repr=False)


class LlmrpcError(Exception):
    """A call ended with a non-OK status (or never reached a server: UNAVAILABLE).

    ``code`` is the ``grpc.StatusCode``; ``code_name`` its name (``"INVALID_ARGUMENT"``).
    ``request_id`` is the caller's, else the one the server made (None if no server answered).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        details: ErrorDetails | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.details = details or ErrorDetails()
        self.request_id = request_id

    @property
    def code_name(self) -> str:
        return self.code.name

    @property
    def field_violations(self) -> tuple[FieldViolation, ...]:
        return self.details.field_violations


def from_rpc_error(error: grpc.RpcError, request_id: str | None = None) -> LlmrpcError:
    """Convert a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    # A status without google.rpc details carries none; from_call raises on a mismatched one.
    try:
        status = rpc_status.from_call(error)
    except ValueError:
        status = None
    raw = tuple(status.details) if status is not None else ()
    request_id = request_id or _server_request_id(error)
    return LlmrpcError(error.code(), error.details() or "", decode_details(raw), request_id)


def _server_request_id(error: grpc.RpcError) -> str | None:
    """The id the server gave the call (``x-request-id`` metadata), for finding it in its logs;
    None when the call never reached a server."""
    for key, value in error.initial_metadata() or ():
        if key == REQUEST_ID_METADATA:
            return value
    return None


def decode_details(raw: tuple[any_pb2.Any, ...]) -> ErrorDetails:
    violations: list[FieldViolation] = []
    retry_delay = resource = reason = None
    for detail in raw:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = _unpack(detail, error_details_pb2.BadRequest)
            violations.extend(
                FieldViolation(v.field, v.description) for v in bad_request.field_violations
            )
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry_delay = _unpack(detail, error_details_pb2.RetryInfo).retry_delay.ToTimedelta()
            retry_delay = retry_delay.total_seconds()
        elif detail.Is(error_details_pb2.ResourceInfo.DESCRIPTOR):
            info = _unpack(detail, error_details_pb2.ResourceInfo)
            resource = ResourceInfo(info.resource_type, info.resource_name, info.description)
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            reason = _unpack(detail, error_details_pb2.ErrorInfo).reason
    return ErrorDetails(tuple(violations), retry_delay, resource, reason, raw)


def _unpack(detail: any_pb2.Any, message_type):
    message = message_type()
    detail.Unpack(message)
    return message
