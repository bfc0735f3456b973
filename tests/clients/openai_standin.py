"""A stand-in OpenAI-compatible peer for testing ``bench serve --backend openai``.

It is NOT the project's REST gateway (that is built elsewhere): just enough of the OpenAI HTTP
API for a benchmark client, ``GET /v1/models`` and streamed ``POST /v1/completions``
(server-sent events, vLLM's ``ignore_eos`` and ``stream_options.include_usage``, text or
token-id prompts), answered by forwarding to a real llmrpc server over gRPC. HTTP/1.1 with
one request per connection, written on asyncio streams to need no web framework.
"""

from __future__ import annotations

import asyncio
import json

from llmrpc.clients import AsyncClient


class OpenAIStandIn:
    def __init__(self, grpc_target: str) -> None:
        self.grpc_target = grpc_target
        self.num_completions = 0

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
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        )
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
            _send_event(writer, {"object": "text_completion", "choices": [choice]})
            if delta.usage is not None and request.get("stream_options", {}).get("include_usage"):
                usage = {
                    "prompt_tokens": delta.usage.prompt_tokens,
                    "completion_tokens": delta.usage.completion_tokens,
                }
                _send_event(writer, {"object": "text_completion", "choices": [], "usage": usage})
            await writer.drain()
        writer.write(b"data: [DONE]\n\n")


def _send_event(writer, payload: dict) -> None:
    writer.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def _read_request(reader) -> tuple[str, str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _ = request_line.split(" ", 2)
    headers = dict(line.split(": ", 1) for line in header_lines if ": " in line)
    length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
    return method, path, await reader.readexactly(length) if length else b""
