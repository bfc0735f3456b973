"""Errors as gRPC status codes with ``google.rpc`` details, never strings inside a success message.

Servicer code raises a ``ServiceError`` (``InvalidArgument``, ``NotFound``, ``Unavailable``,
``FailedPrecondition``, ``ResourceExhausted``);
``handle_errors`` turns it into a status with details a client can read with
``grpc_status.rpc_status.from_call``. Any other exception is a bug: it is logged with its
traceback and the call ends with INTERNAL.
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

logger = logging.getLogger(__name__)

_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[Any]])


class ServiceError(Exception):
    """An error a client caused or can act on; becomes the call's status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, details: tuple[Message, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_grpc_status(self) -> grpc.Status:
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        for detail in self.details:
            packed = any_pb2.Any()
            packed.Pack(detail)
            status.details.append(packed)
        return rpc_status.to_status(status)


def _bad_request(field: str, description: str) -> error_details_pb2.BadRequest:
    violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
    return error_details_pb2.BadRequest(field_violations=[violation])


class InvalidArgument(ServiceError):
    """A request field is wrong; ``field`` is its path in the request, e.g. "sampling.top_p"."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}", (_bad_request(field, description),))
        self.field = field


class NotFound(ServiceError):
    """A named resource (e.g. a model) does not exist; names the request field that named it."""

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, resource_type: str, name: str, field: str, description: str) -> None:
        resource = error_details_pb2.ResourceInfo(
            resource_type=resource_type, resource_name=name, description=description
        )
        super().__init__(f"{field}: {description}", (resource, _bad_request(field, description)))
        self.field = field


class AlreadyExists(ServiceError):
    """A resource of that name exists already (e.g. a LoRA adapter)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class DeadlineExceeded(ServiceError):
    """The request was dropped from the queue: it could not start before the call's deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServiceError):
    """The server cannot serve now (model still loading, engine stopped); retrying may help."""

    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(ServiceError):
    """The server is not in a state to do this (asleep, busy, a feature off); a PreconditionFailure
    detail says which precondition (``subject``) and why."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, subject: str, description: str) -> None:
        violation = error_details_pb2.PreconditionFailure.Violation(
            type="STATE", subject=subject, description=description
        )
        super().__init__(
            description, (error_details_pb2.PreconditionFailure(violations=[violation]),)
        )


class ResourceExhausted(ServiceError):
    """The server is full; a RetryInfo detail says when to try again."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float) -> None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromTimedelta(datetime.timedelta(seconds=retry_after_s))
        super().__init__(message, (retry,))


class OutOfRange(ServiceError):
    """A position past what the server has (a KV event batch it no longer keeps)."""

    code = grpc.StatusCode.OUT_OF_RANGE


class DataLoss(ServiceError):
    """What the client was streamed has gaps it cannot be given back (a KV event subscriber
    that fell behind)."""

    code = grpc.StatusCode.DATA_LOSS


class Unimplemented(ServiceError):
    """An RPC of a foreign service this server does not provide (a profiler, KV events off)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(ServiceError):
    """A failure inside the server: a bug, never the client's doing."""

    code = grpc.StatusCode.INTERNAL


def handle_errors(handler: _Handler) -> _Handler:
    """Decorate an async servicer method ``(self, request, context)``: errors become statuses."""

    @functools.wraps(handler)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise  # the handler already ended the call with a status
        except ServiceError as error:
            await context.abort_with_status(error.to_grpc_status())
        except Exception as error:  # noqa: BLE001 - anything else is a bug: log it, say INTERNAL
            logger.exception("bug in %s", handler.__qualname__)
            internal = Internal(
                f"internal error ({type(error).__name__}); the server log has the traceback"
            )
            await context.abort_with_status(internal.to_grpc_status())

    return wrapper  # type: ignore[return-value]
