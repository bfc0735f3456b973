"""``AsyncClient``: the asyncio client over ``grpc.aio`` (the API is in ``llmrpc.clients.base``).

Every method is a coroutine, except ``stream`` and ``chat_stream``, which return async
iterators:

    async with AsyncClient("127.0.0.1:50051") as client:
        async for delta in client.stream("Hello", max_tokens=8):
            print(delta.text, end="")

A client belongs to the event loop it was created on (as grpc.aio channels do).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from llmrpc.clients.base import ClientBase
from llmrpc.clients.connection import deadline_of, remaining, retry_delay
from llmrpc.clients.errors import LlmrpcError, from_rpc_error
from llmrpc.clients.types import Delta, delta_from_proto


class AsyncClient(ClientBase):
    """An asyncio client over one grpc.aio channel."""

    def _open_channel(self) -> grpc.aio.Channel:
        options = self.options
        if options.uses_tls:
            return grpc.aio.secure_channel(
                options.address, options.credentials(), options.channel_options()
            )
        return grpc.aio.insecure_channel(options.address, options.channel_options())

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def watch_health(self, service: str = "") -> AsyncIterator[str]:
        """The health status ("SERVING", "NOT_SERVING"...) now and at each change, from the
        standard health Watch stream; ends with ``LlmrpcError`` when the connection fails."""
        request = health_pb2.HealthCheckRequest(service=service)
        call = self._health.Watch(request, metadata=self.options.metadata())
        try:
            async for response in call:
                yield health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        except grpc.RpcError as rpc_error:
            raise from_rpc_error(rpc_error) from None
        finally:
            call.cancel()

    async def kserve_call(self, method: str, request, *, timeout=None, request_id=None):
        """One unary call of KServe v2's ``inference.GRPCInferenceService`` (``"ModelInfer"``,
        ``"ModelMetadata"``...) with its request message; its response message."""
        stub_method = getattr(self._kserve, method)
        return await self._call(stub_method, request, lambda reply: reply, timeout, request_id)

    async def kserve_stream(self, request, *, timeout=None, request_id=None) -> AsyncIterator:
        """KServe v2's ``ModelStreamInfer`` with one request: its ``ModelStreamInferResponse``s."""
        deadline = deadline_of(self.options.timeout if timeout is None else timeout)
        call = self._kserve.ModelStreamInfer(
            iter([request]), timeout=remaining(deadline), metadata=self.options.metadata(request_id)
        )
        try:
            async for response in call:
                yield response
        except grpc.RpcError as rpc_error:
            raise from_rpc_error(rpc_error, request_id) from None
        finally:
            call.cancel()  # a no-op once the call ended; aborts it if the caller stopped early

    async def _call(self, method, request, convert, timeout, request_id=None):
        deadline = deadline_of(self.options.timeout if timeout is None else timeout)
        metadata = self.options.metadata(request_id)
        attempt = 1
        while True:
            try:
                response = await method(request, timeout=remaining(deadline), metadata=metadata)
                return convert(response)
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error, request_id)
            delay = retry_delay(self.options.retry, error, attempt, deadline)
            if delay is None:
                raise error
            await asyncio.sleep(delay)
            attempt += 1

    async def _stream(self, request, timeout, request_id) -> AsyncIterator[Delta]:
        deadline = deadline_of(self.options.timeout if timeout is None else timeout)
        metadata = self.options.metadata(request_id)
        attempt = 1
        while True:
            call = self._generation.GenerateStream(
                request, timeout=remaining(deadline), metadata=metadata
            )
            received = False
            try:
                async for response in call:
                    received = True
                    yield delta_from_proto(response)
                return
            except grpc.RpcError as rpc_error:
                error: LlmrpcError = from_rpc_error(rpc_error, request_id)
            finally:
                call.cancel()  # a no-op once the call ended; aborts it if the caller stopped early
            delay = None if received else retry_delay(self.options.retry, error, attempt, deadline)
            if delay is None:
                raise error
            await asyncio.sleep(delay)
            attempt += 1
