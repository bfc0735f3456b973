"""A stand-in OpenAI-compatible peer for testing ``bench serve --backend openai``.

It is NOT the project's REST gateway (that is built elsewhere): just enough of the OpenAI HTTP
API for a benchmark client, ``GET /v1/models`` and streamed ``POST /v1/completions``
(server-sent events, vLLM's ``ignore_eos`` and ``stream_options.include_usage``, text or
token-id prompts), answered by forwarding to a real llmrpc server over gRPC. HTTP/1.1 with
one request per connection, written on asyncio streams to need no web framework.

With ``unannounced_close`` its completions come in chunked encoding with no ``Connection:
close``, so a client may keep the connection for another request, which the stand-in drops
unanswered: llama.cpp's server, streaming, lost 15-24 of 96 requests that way to an aiohttp
client that kept its connections (32 at once).
"""

from __future__ import annotations

import asyncio
import json

from llmrpc.clients import AsyncClient


class OpenAIStandIn:
    def __init__(self, grpc_target: str, unannounced_close: bool = False) -> None:
        self.grpc_target = grpc_target
        self.unannounced_close = unannounced_close
        self.num_completions = 0
        self.num_dropped = 0  # requests that came on a connection already used

    async def start(self) -> int:
        """Listen on a loopback port chosen by the OS; returns it."""
        self.client = AsyncClient(self.grpc_target)
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()
        await self.client.close()

    async def _serve(self, reader, writer) -> None:
        try:
            method, path, body = await _read_request(reader)
            if (method, path) == ("GET", "/v1/models"):
                await self._models(writer)
            elif (method, path) == ("POST", "/v1/completions"):
                await self._completions(writer, json.loads(body))
                if self.unannounced_close and await reader.read(1):  # a second request
                    self.num_dropped += 1
            else:
                # it closes every connection after one request, and says so: a client that kept
                # this one for its next request (GET /metrics, then a completion) would lose it
                writer.write(
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
        finally:
            await writer.drain()
            writer.close()

    async def _models(self, writer) -> None:
        models = [{"id": m.id, "object": "model"} for m in await self.client.models()]
        body = json.dumps({"object": "list", "data": models}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )

    async def _completions(self, writer, request: dict) -> None:
        self.num_completions += 1
        framing = b"Transfer-Encoding: chunked" if self.unannounced_close else b"Connection: close"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n%s\r\n\r\n" % framing)

        def send(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data) if self.unannounced_close else data)

        stream = self.client.stream(
            request["prompt"],
            model=request["model"],
            max_tokens=request["max_tokens"],
            temperature=request.get("temperature"),
            ignore_eos=request.get("ignore_eos"),
        )
        async for delta in stream:
            finish = delta.finish_reason.value if delta.finish_reason else None
            choice = {"index": 0, "text": delta.text, "finish_reason": finish}
            send(_event({"object": "text_completion", "choices": [choice]}))
            if delta.usage is not None and request.get("stream_options", {}).get("include_usage"):
                usage = {
                    "prompt_tokens": delta.usage.prompt_tokens,
                    "completion_tokens": delta.usage.completion_tokens,
                }
                send(_event({"object": "text_completion", "choices": [], "usage": usage}))
            await writer.drain()
        send(b"data: [DONE]\n\n")
        if self.unannounced_close:
            writer.write(b"0\r\n\r\n")


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _read_request(reader) -> tuple[str, str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _ = request_line.split(" ", 2)
    headers = dict(line.split(": ", 1) for line in header_lines if ": " in line)
    length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
    return method, path, await reader.readexactly(length) if length else b""
