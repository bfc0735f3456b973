"""Server interceptors: who is calling (API keys); the request id and in-flight count of v1 calls.

Both wrap the method handler gRPC found for a call, so they run in the call's own task, before
the servicer, and see its metadata (and, for the request id, its request message).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator

import grpc

from llmrpc.server.auth import Caller, KeyRing, RequestOwners, caller_var, needs_admin
from llmrpc.server.errors import InvalidArgument
from llmrpc.server.logs import request_id_var
from llmrpc.v1.headers import AUTHORIZATION, REQUEST_ID, request_id_problem

logger = logging.getLogger(__name__)

REQUEST_ID_METADATA = REQUEST_ID
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


def _wrap_handler(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior], Behavior]
) -> grpc.RpcMethodHandler:
    """The same handler with its behavior (whatever its kind) wrapped."""
    kind = next(kind for kind in _HANDLER_KINDS if getattr(handler, kind) is not None)
    return handler._replace(**{kind: wrap(getattr(handler, kind))})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Calls carry ``authorization: Bearer <key>`` (see ``llmrpc.v1.headers.bearer_key``); the
    key makes the caller (``auth``), which the call's task then knows as ``caller_var``.
    ``exempt_services`` (health, reflection) need no key. UNAUTHENTICATED without a key that
    the call needs; PERMISSION_DENIED for an admin-only RPC with a generation key."""

    def __init__(self, keys: KeyRing, exempt_services: Iterable[str]) -> None:
        self._keys = keys
        self._exempt = frozenset(exempt_services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or _service_of(method) in self._exempt:
            return handler
        authorization = _metadata_value(handler_call_details.invocation_metadata, AUTHORIZATION)
        caller = self._keys.caller(authorization)
        refusal = self._refusal(caller, method)
        if refusal is not None:
            return _wrap_handler(handler, lambda _: refusal)
        return _wrap_handler(handler, lambda behavior: _as_caller(caller, behavior))

    def _refusal(self, caller: Caller | None, method: str) -> Behavior | None:
        if caller is None:
            return _refuse(grpc.StatusCode.UNAUTHENTICATED, _NO_KEY)
        if needs_admin(method) and self._keys.admin_required and not caller.admin:
            if caller.key_digest is None:
                return _refuse(grpc.StatusCode.UNAUTHENTICATED, _NO_ADMIN_KEY)
            return _refuse(grpc.StatusCode.PERMISSION_DENIED, _NOT_ADMIN)
        return None


_NO_KEY = "missing or wrong API key: send the metadata 'authorization: Bearer <key>'"
_NO_ADMIN_KEY = "this call needs an admin API key: send 'authorization: Bearer <admin key>'"
_NOT_ADMIN = "this call needs an admin API key (--admin-api-key); this key may only generate"


def _refuse(code: grpc.StatusCode, message: str) -> Behavior:
    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return refuse


def _as_caller(caller: Caller, behavior: Behavior) -> Behavior:
    async def as_caller(request, context: grpc.aio.ServicerContext):
        caller_var.set(caller)  # the call's own task: no other call sees it
        return await behavior(request, context)

    return as_caller


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
    response's initial metadata (so it arrives even with an error); its caller recorded in
    ``owners`` (for Abort) and a count in ``calls``, while it runs.

    The id is the request's own ``request_id`` field if set, else the ``x-request-id`` metadata,
    else a new one; a bad one (``llmrpc.v1.headers.request_id_problem``) ends the call with
    INVALID_ARGUMENT naming where it came from, before it is echoed or logged.
    """

    def __init__(
        self, services: Iterable[str], calls: CallsInFlight, owners: RequestOwners | None = None
    ) -> None:
        self._services = frozenset(services)
        self._calls = calls
        self._owners = owners or RequestOwners()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or _service_of(handler_call_details.method) not in self._services:
            return handler
        return _wrap_handler(handler, self._in_context)

    def _in_context(self, behavior: Behavior) -> Behavior:
        async def in_context(request, context: grpc.aio.ServicerContext):
            try:
                request_id = _request_id(request, context.invocation_metadata())
            except InvalidArgument as error:
                await context.abort_with_status(error.to_grpc_status())
            request_id_var.set(request_id)  # the call's own task: no other call sees it
            await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
            with self._owners.record(request_id, caller_var.get().key_digest):
                return await self._calls.run(behavior(request, context), context)

        return in_context


def _request_id(request, metadata) -> str:
    """The request's ``request_id`` field, else the ``x-request-id`` metadata, else a new id;
    InvalidArgument naming the field or the metadata a bad one came from."""
    given = (
        ("request_id", getattr(request, "request_id", "")),
        (REQUEST_ID_METADATA, _metadata_value(metadata, REQUEST_ID_METADATA)),
    )
    for source, value in given:
        if value:
            if problem := request_id_problem(value):
                raise InvalidArgument(source, problem)
            return value
    return uuid.uuid4().hex
