"""Server interceptors: the API key check; the request id and in-flight count of v1 calls.

Both wrap the method handler gRPC found for a call, so they run in the call's own task, before
the servicer, and see its metadata (and, for the request id, its request message).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator

import grpc

from llmrpc.server.logs import request_id_var

logger = logging.getLogger(__name__)

REQUEST_ID_METADATA = "x-request-id"
_BEARER = "bearer "
_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")

Behavior = Callable[..., Awaitable]


def _service_of(method: str) -> str:
    """``/package.Service/Method`` -> ``package.Service``."""
    return method.split("/")[1] if method.count("/") == 2 else ""


def _metadata_value(metadata, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return value
    return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _wrap_handler(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior], Behavior]
) -> grpc.RpcMethodHandler:
    """The same handler with its behavior (whatever its kind) wrapped."""
    kind = next(kind for kind in _HANDLER_KINDS if getattr(handler, kind) is not None)
    return handler._replace(**{kind: wrap(getattr(handler, kind))})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Calls must carry ``authorization: Bearer <key>`` with one of ``--api-key``'s keys;
    ``exempt_services`` (health, reflection) need none. Otherwise: UNAUTHENTICATED."""

    def __init__(self, keys: Iterable[str], exempt_services: Iterable[str]) -> None:
        self._key_digests = [_digest(key) for key in keys]
        self._exempt = frozenset(exempt_services)

    def authorized(self, metadata) -> bool:
        value = _metadata_value(metadata, "authorization") or ""
        if value[: len(_BEARER)].lower() != _BEARER:
            return False
        presented = _digest(value[len(_BEARER) :].strip())
        # Digests of equal length, each compared in constant time with every key: the time taken
        # tells nothing about a key's length or contents, nor which key matched.
        matches = [hmac.compare_digest(presented, key) for key in self._key_digests]
        return any(matches)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        exempt = _service_of(handler_call_details.method) in self._exempt
        if handler is None or exempt or self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _wrap_handler(handler, lambda _: _refuse)


async def _refuse(request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or wrong API key: send the metadata 'authorization: Bearer <key>'",
    )


class CallsInFlight:
    """The llmrpc.v1 calls running, each as a task of its own: a stopping server waits for them
    to finish, or cuts them short (a second SIGTERM) with UNAVAILABLE for their clients."""

    def __init__(self) -> None:
        self.count = 0
        self._tasks: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = False

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one call in flight for the block."""
        self.count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= 1
            if not self.count:
                self._idle.set()

    async def run(self, work: Awaitable, context: grpc.aio.ServicerContext):
        """Run one call's ``work``, counted, in a task that ``cut_all`` can cancel."""
        with self.track():
            task = asyncio.ensure_future(work)
            self._tasks.add(task)
            try:
                return await task
            except asyncio.CancelledError:
                if self._cut:  # by cut_all(), not by the client: say why
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping")
                raise
            finally:
                self._tasks.discard(task)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def cut_all(self) -> None:
        self._cut = True
        for task in self._tasks:
            task.cancel()


class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """For each call to ``services``: a request id, bound to the logs and echoed at once in the
    response's initial metadata (so it arrives even with an error); and a count in ``calls``.

    The id is the request's own ``request_id`` field if set, else the ``x-request-id`` metadata,
    else a new one.
    """

    def __init__(self, services: Iterable[str], calls: CallsInFlight) -> None:
        self._services = frozenset(services)
        self._calls = calls

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or _service_of(handler_call_details.method) not in self._services:
            return handler
        return _wrap_handler(handler, self._in_context)

    def _in_context(self, behavior: Behavior) -> Behavior:
        async def in_context(request, context: grpc.aio.ServicerContext):
            request_id = getattr(request, "request_id", "") or _metadata_value(
                context.invocation_metadata(), REQUEST_ID_METADATA
            )
            request_id = request_id or uuid.uuid4().hex
            request_id_var.set(request_id)  # the call's own task: no other call sees it
            await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
            return await self._calls.run(behavior(request, context), context)

        return in_context
