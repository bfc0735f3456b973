"""Calls on the network port must send their request message in time, and a valid one.

grpc.aio reads a unary request's message before it runs the method's handler, with no time
limit: a stream whose headers arrived and whose message never does holds its call, its task and
its buffers for as long as the connection lives (seen: 14,000 idle streams a connection, RSS
up 1.2 GB, with a wrong key). This interceptor turns every method whose request is one message
into one that reads its message itself, after the interceptors outside it have run, so

- an API key refused by ``ApiKeyInterceptor`` (outside this one) ends the call before any
  message is read: a wrong key costs nothing;
- a message that has not arrived ``timeout_s`` after the call's headers ends the call with
  DEADLINE_EXCEEDED naming ``--grpc-request-message-timeout``;
- bytes that are not the method's protobuf are INVALID_ARGUMENT naming its message type, where
  grpc.aio would answer UNKNOWN;
- a call that half-closes without a message is INVALID_ARGUMENT.

Methods that stream their requests (reflection) get the same bound on their first message.
Only the network server has it: the in-process channel hands over messages already built.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

FLAG = "--grpc-request-message-timeout"


class RequestMessageDeadline(grpc.aio.ServerInterceptor):
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming:
            return self._bound_first_of_stream(handler)
        behavior = handler.unary_stream or handler.unary_unary
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a synchronous handler (none here) is run on a thread by grpc.aio
        type_name = _message_type(handler.request_deserializer)
        if handler.response_streaming:
            return handler._replace(
                request_streaming=True,
                unary_stream=None,
                stream_stream=self._reading(handler.unary_stream, type_name, streamed=True),
            )
        return handler._replace(
            request_streaming=True,
            unary_unary=None,
            stream_unary=self._reading(handler.unary_unary, type_name, streamed=False),
        )

    def _reading(self, behavior, type_name: str, streamed: bool):
        """``behavior`` of a one-message request, as a request-streaming one reading it."""

        async def unary_response(_requests, context: grpc.aio.ServicerContext):
            return await behavior(await self._first_message(context, type_name), context)

        async def streamed_response(_requests, context: grpc.aio.ServicerContext) -> None:
            responses = behavior(await self._first_message(context, type_name), context)
            if hasattr(responses, "__aiter__"):  # an async generator handler
                async for response in responses:
                    await context.write(response)
            else:  # a coroutine writing through the context
                await responses

        return streamed_response if streamed else unary_response

    async def _first_message(self, context: grpc.aio.ServicerContext, type_name: str):
        try:
            request = await asyncio.wait_for(context.read(), self.timeout_s)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self._late())
        except DecodeError:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request message is not a valid {type_name} (protobuf)",
            )
        if request is grpc.aio.EOF:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message"
            )
        return request

    def _late(self) -> str:
        return f"no request message within {self.timeout_s:g} s of the call's start ({FLAG})"

    def _bound_first_of_stream(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kind = "stream_stream" if handler.response_streaming else "stream_unary"
        behavior = getattr(handler, kind)

        # grpc.aio runs a handler by its kind of function: each wrapper is of its original's.
        async def bounded_generator(requests, context: grpc.aio.ServicerContext):
            async for response in behavior(self._first_in_time(requests, context), context):
                yield response

        async def bounded_coroutine(requests, context: grpc.aio.ServicerContext):
            return await behavior(self._first_in_time(requests, context), context)

        if inspect.isasyncgenfunction(behavior):
            return handler._replace(**{kind: bounded_generator})
        if inspect.iscoroutinefunction(behavior):
            return handler._replace(**{kind: bounded_coroutine})
        return handler  # a synchronous handler (none here) reads on a thread of its own

    async def _first_in_time(self, requests, context) -> AsyncIterator:
        iterator = requests.__aiter__()
        try:
            first = await asyncio.wait_for(iterator.__anext__(), self.timeout_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self._late())
        yield first
        async for request in iterator:
            yield request


def _message_type(deserializer) -> str:
    """The protobuf type a method's deserializer (``Message.FromString``) reads."""
    message_class = getattr(deserializer, "__self__", None)
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    return descriptor.full_name if descriptor is not None else "request"
