"""An in-process gRPC channel to this server's own services, for the REST gateway it runs.

A call on it goes through what a network call goes through here (the interceptors, with their
API key check, request ids and drain accounting, then the servicer) and ends the same way (the
servicer's status, details and metadata, raised to the caller as ``grpc.aio.AioRpcError``), but
its messages pass as objects: no serialization, no HTTP/2, no poller-thread wake-up per
message. Per streamed token that is most of what the gateway would otherwise add to the
server's work. ``llmrpc gateway`` in front of remote replicas uses real gRPC channels. Since
nothing is copied, neither side may change a message once handed over (the servicers build a
new message for every response, and the clients one for every request).

Each call runs in a task of its own, as grpc.aio runs a handler: cancelling the call (the
client closes its stream, or its deadline passes) cancels that task, which aborts the engine
request. Streamed responses wait in a short queue, so a slow reader holds the servicer back as
flow control would. Unary-unary, unary-stream and stream-stream methods are served (the
last with the requests given as an iterable: KServe v2's ModelStreamInfer, which the gateway's
generate_stream route calls with one request).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

import grpc

STREAM_BUFFER = 8  # responses a stream holds before the servicer's write waits for its reader


class _CallDetails(NamedTuple):  # grpc.HandlerCallDetails, as interceptors see it
    method: str
    invocation_metadata: tuple


class _Status(NamedTuple):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple = ()


class HandlerRegistry:
    """Collects the generic handlers that the ``add_*_to_server`` functions register."""

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        pass  # the generic handlers above already answer for these methods


class _Context:
    """The parts of ``grpc.aio.ServicerContext`` a handler here uses."""

    def __init__(self, call: _Call, metadata: tuple, deadline: float | None) -> None:
        self._call = call
        self._metadata = metadata
        self._deadline = deadline
        self.initial_metadata: tuple = ()
        self.status: _Status | None = None

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    async def send_initial_metadata(self, metadata) -> None:
        self.initial_metadata = tuple(metadata)

    async def write(self, message) -> None:
        await self._call.put(message)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        raise _abort(self, code, details, tuple(trailing_metadata))

    async def abort_with_status(self, status) -> None:
        raise _abort(self, status.code, status.details, tuple(status.trailing_metadata))


_END = object()  # a stream's last item; ``_Call.error`` then says how it ended


class _Call:
    """One call: its handler task and, for a stream, the responses written and not yet read.

    Awaited, it gives the unary response; iterated, the streamed ones. Either raises
    ``grpc.aio.AioRpcError`` for a call that did not end with OK.
    """

    def __init__(
        self, channel: LoopbackChannel, method: str, stream: bool, request, *,
        timeout=None, metadata=None, **_options,
    ) -> None:  # fmt: skip
        self.stream = stream
        self._responses: collections.deque = collections.deque()
        self._readable = asyncio.Event()
        self._room = asyncio.Semaphore(STREAM_BUFFER)
        deadline = None if timeout is None else time.monotonic() + timeout
        self.context = _Context(self, tuple(metadata or ()), deadline)
        self.error: grpc.aio.AioRpcError | None = None
        self.ended_by: _Status | None = None  # set when the channel cancels the call itself
        self.task = asyncio.ensure_future(channel.run(method, request, self, timeout))

    def fail(self, status: _Status) -> None:
        initial = grpc.aio.Metadata(*self.context.initial_metadata)
        trailing = grpc.aio.Metadata(*status.trailing_metadata)
        self.error = grpc.aio.AioRpcError(status.code, initial, trailing, status.details)

    def end_with(self, status: _Status) -> None:
        """Cancel the call from the channel's side, ending it with ``status``."""
        self.ended_by = status
        self.task.cancel()

    def cancel(self) -> bool:
        return self.task.cancel()

    async def put(self, message) -> None:
        await self._room.acquire()
        self._push(message)

    def _push(self, item) -> None:
        self._responses.append(item)
        self._readable.set()

    def end(self) -> None:
        self._push(_END)

    def __await__(self):
        return self.task.__await__()

    async def __aiter__(self) -> AsyncIterator:
        while True:
            if not self._responses:
                self._readable.clear()
                await self._readable.wait()
            item = self._responses.popleft()
            if item is _END:
                break
            self._room.release()
            yield item
        if self.error is not None:
            raise self.error


class LoopbackChannel:
    """A ``grpc.aio.Channel`` stand-in for the generated stubs, served by ``registry``'s
    handlers behind ``interceptors`` (outermost first, as the server applies them)."""

    def __init__(self, registry: HandlerRegistry, interceptors: Sequence) -> None:
        self._registry = registry
        self._handler = self._lookup
        for interceptor in reversed(interceptors):  # built once: the chain never changes
            self._handler = _bind(interceptor, self._handler)
        self._calls: set[_Call] = set()
        self._closed = False

    def unary_unary(self, method: str, *_codecs, **_options):
        return functools.partial(_Call, self, method, False)

    def unary_stream(self, method: str, *_codecs, **_options):
        return functools.partial(_Call, self, method, True)

    def stream_stream(self, method: str, *_codecs, **_options):
        return functools.partial(_Call, self, method, True)

    async def _lookup(self, details: _CallDetails):
        for generic in self._registry.handlers:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    async def run(self, method: str, request, call: _Call, timeout: float | None):
        """Serve ``call`` to its end; the handler's response (unary), or None (stream)."""
        self._calls.add(call)
        loop = asyncio.get_running_loop()
        expiry = None
        if timeout is not None:
            status = _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            expiry = loop.call_later(timeout, call.end_with, status)
        try:
            return await self._serve(method, request, call.context)
        except grpc.aio.AbortError:
            call.fail(call.context.status or _Status(grpc.StatusCode.UNKNOWN, "aborted"))
        except asyncio.CancelledError:
            call.fail(call.ended_by or _Status(grpc.StatusCode.CANCELLED, "Cancelled"))
            if call.ended_by is None:  # the caller cancelled: it wants no answer
                raise
        except Exception as error:  # noqa: BLE001 - what grpc.aio answers for an unhandled one
            call.fail(_Status(grpc.StatusCode.UNKNOWN, f"Unexpected {type(error)}: {error}"))
        finally:
            if expiry is not None:
                expiry.cancel()
            self._calls.discard(call)
            call.end()
        if not call.stream:  # a stream's reader gets the error after the responses
            raise call.error
        return None

    async def _serve(self, method: str, request, context: _Context):
        if self._closed:
            raise _abort(context, grpc.StatusCode.UNAVAILABLE, "the server is stopping")
        handler = await self._handler(_CallDetails(method, context.invocation_metadata()))
        if handler is None:
            raise _abort(context, grpc.StatusCode.UNIMPLEMENTED, f"unknown method {method}")
        if handler.unary_unary is not None:
            return await handler.unary_unary(request, context)
        if handler.unary_stream is not None:
            responses = handler.unary_stream(request, context)
            if hasattr(responses, "__aiter__"):  # an async generator handler
                async for response in responses:
                    await context.write(response)
            else:  # a coroutine handler writing through the context
                await responses
            return None
        if handler.stream_stream is not None:  # ``request``: the iterable of requests
            await handler.stream_stream(_requests(request), context)
            return None
        raise _abort(context, grpc.StatusCode.UNIMPLEMENTED, f"{method}: not served in-process")

    async def stop(self, grace: float | None) -> None:
        """As ``grpc.aio.Server.stop``: refuse new calls at once; give those in flight ``grace``
        seconds (None: as long as they take), then end them UNAVAILABLE."""
        self._closed = True
        if self._calls:
            await asyncio.wait([call.task for call in self._calls], timeout=grace)
        for call in list(self._calls):
            call.end_with(_Status(grpc.StatusCode.UNAVAILABLE, "the server is stopping"))

    async def close(self) -> None:
        """Cancel the calls in flight (a client closing its channel)."""
        for call in list(self._calls):
            call.cancel()


async def _requests(requests) -> AsyncIterator:
    for request in requests:
        yield request


def _bind(interceptor, continuation):
    async def intercepted(details: _CallDetails):
        return await interceptor.intercept_service(continuation, details)

    return intercepted


def _abort(context: _Context, code, details: str, trailing=()) -> grpc.aio.AbortError:
    context.status = _Status(code, details, trailing)
    return grpc.aio.AbortError(details)
