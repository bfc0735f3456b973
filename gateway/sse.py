"""Server-sent events as OpenAI sends them, and the client-disconnect rule.

Each event is ``data: {json}\\n\\n``; a stream ends with ``data: [DONE]\\n\\n``. An error after
the stream began is sent as an event ``data: {"error": {...}}`` (the OpenAI SDK raises it), then
``[DONE]``. A client that goes away cancels the upstream gRPC call, which aborts the request in
the engine: Starlette cancels a streaming body on disconnect, and ``until_disconnect`` does the
same for a request still waiting for its answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import StreamingResponse

from llmrpc.clients import LlmrpcError
from llmrpc.gateway.errors import ClientGone, OpenAIError, from_grpc

DONE = b"data: [DONE]\n\n"


def dumps(body) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


class ChunkFramer:
    """Writes the chunks of one streamed response: the fields every chunk repeats are encoded
    once, then each chunk adds its choices (and ``usage`` where asked for)."""

    def __init__(self, response_id: str, kind: str, created: int, model: str, usage: bool) -> None:
        head = dumps({"id": response_id, "object": kind, "created": created, "model": model})
        self._head = b"data: " + head[:-1].encode() + b',"choices":['
        self._tail = b'],"usage":null}\n\n' if usage else b"]}\n\n"

    def choice(self, choice: dict) -> bytes:
        return self._head + dumps(choice).encode() + self._tail

    def usage(self, usage: dict) -> bytes:
        return self._head + b'],"usage":' + dumps(usage).encode() + b"}\n\n"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable):
    """Await ``awaitable``, cancelling it (and raising ``ClientGone``) if the client leaves."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watcher.done()
        watcher.cancel()
        if not work.done():
            work.cancel()
            # Cancelling only asks: wait until the work (and the gRPC call it aborts) has ended,
            # however it ends, so nothing is left running and no outcome goes unread.
            await asyncio.wait((work,))
    if gone:
        watcher.exception()  # a receive that failed is a client gone too
        if not work.cancelled():
            work.exception()  # read, so asyncio does not log it as never retrieved
        raise ClientGone
    return work.result()


async def first_then_rest(
    request: Request, chunks: AsyncIterator[bytes], names: dict | None = None
) -> StreamingResponse:
    """An SSE response from ``chunks``, sent once the first chunk exists: an error before it
    is answered with its HTTP status, an error after it as an error event. ``names``: see
    ``errors.from_grpc``."""
    try:
        first = await until_disconnect(request, anext(chunks))
    except LlmrpcError as error:
        await chunks.aclose()
        raise from_grpc(error, names) from None
    except BaseException:
        await chunks.aclose()
        raise
    body = _body(first, chunks, names)
    return StreamingResponse(body, media_type="text/event-stream")


async def _body(first: bytes, chunks: AsyncIterator[bytes], names) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in chunks:
            yield chunk
    except LlmrpcError as error:
        yield from_grpc(error, names).sse_event()
        yield DONE
    except OpenAIError as error:
        yield error.sse_event()
        yield DONE
    finally:
        await chunks.aclose()
