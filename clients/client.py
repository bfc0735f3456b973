"""``Client``: the blocking client (the API is documented in ``llmrpc.clients.base``).

Every method returns its result; ``stream`` and ``chat_stream`` return iterators:

    with Client("127.0.0.1:50051") as client:
        for delta in client.stream("Hello", max_tokens=8):
            print(delta.text, end="")
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc

from llmrpc.clients.base import ClientBase
from llmrpc.clients.connection import deadline_of, remaining, retry_delay
from llmrpc.clients.errors import LlmrpcError, from_rpc_error
from llmrpc.clients.types import Delta, delta_from_proto


class Client(ClientBase):
    """A blocking client over one gRPC channel; safe to share between threads."""

    def _open_channel(self) -> grpc.Channel:
        options = self.options
        if options.uses_tls:
            return grpc.secure_channel(
                options.address, options.credentials(), options.channel_options()
            )
        return grpc.insecure_channel(options.address, options.channel_options())

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call(self, method, request, convert, timeout, request_id=None):
        deadline = deadline_of(self.options.timeout if timeout is None else timeout)
        metadata = self.options.metadata(request_id)
        attempt = 1
        while True:
            try:
                response = method(request, timeout=remaining(deadline), metadata=metadata)
                return convert(response)
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error, request_id)
            delay = retry_delay(self.options.retry, error, attempt, deadline)
            if delay is None:
                raise error
            time.sleep(delay)
            attempt += 1

    def _stream(self, request, timeout, request_id) -> DeltaStream:
        return DeltaStream(lambda stream: self._deltas(request, timeout, request_id, stream))

    def _deltas(self, request, timeout, request_id, stream: DeltaStream) -> Iterator[Delta]:
        deadline = deadline_of(self.options.timeout if timeout is None else timeout)
        metadata = self.options.metadata(request_id)
        attempt = 1
        while True:
            call = self._generation.GenerateStream(
                request, timeout=remaining(deadline), metadata=metadata
            )
            stream.call = call
            if stream.cancelled:
                call.cancel()
            received = False
            try:
                for response in call:
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
            time.sleep(delay)
            attempt += 1


class DeltaStream:
    """The deltas of one streamed generation, as an iterator. ``cancel()`` ends the call from any
    thread or from a signal handler (where ``close()``, a generator's, cannot run while the loop
    over the deltas is waiting): the loop then raises ``LlmrpcError`` (CANCELLED)."""

    def __init__(self, start: Callable[[DeltaStream], Iterator[Delta]]) -> None:
        self.call = None  # the gRPC call of the attempt under way
        self.cancelled = False
        self._deltas = start(self)

    def __iter__(self) -> DeltaStream:
        return self

    def __next__(self) -> Delta:
        return next(self._deltas)

    def close(self) -> None:
        """Stop early: cancels the call if it is still open."""
        self._deltas.close()

    def cancel(self) -> None:
        self.cancelled = True
        if self.call is not None:
            self.call.cancel()
