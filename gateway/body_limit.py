"""The REST gateway's request-body limit and body read timeout (pure ASGI middleware).

Without them one client could hold the server's memory and event loop with a 100 MB body, or a
connection for ever by trickling its body a byte at a time. A request that declares a body is
read whole here, before the app sees it:

- a ``Content-Length`` over the limit is refused at once (413), before any of the body is read;
- a body that passes the limit while it arrives (chunked) is refused as soon as it does (413);
- a body not complete within the read timeout is refused (408).

Both refusals carry ``connection: close``, so the server stops reading the rest of the body.
The app then receives the body as one message; its later ``receive`` calls go to the server,
so a client that disconnects is still seen.
"""

from __future__ import annotations

import asyncio

from llmrpc.gateway.errors import OpenAIError


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _declared_length(scope) -> int | None:
    value = _header(scope, b"content-length")
    if value is None or not value.strip().isdigit():
        return None  # none, or malformed: the HTTP server refuses those itself
    return int(value)


def _has_body(scope) -> bool:
    length = _declared_length(scope)
    return bool(length) or _header(scope, b"transfer-encoding") is not None


async def _refuse(scope, receive, send, status: int, message: str) -> None:
    response = OpenAIError(status, message).response()
    response.headers["connection"] = "close"  # the rest of the body is never read
    await response(scope, receive, send)


class BodyLimitMiddleware:
    """Bodies of at most ``max_size`` bytes, read within ``timeout_s`` seconds."""

    def __init__(self, app, max_size: int, timeout_s: float) -> None:
        self.app = app
        self.max_size = max_size
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            return await self.app(scope, receive, send)
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_size:
            return await self._too_large(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except _TooLarge:
            return await self._too_large(scope, receive, send)
        except asyncio.TimeoutError:
            message = (
                f"the request body did not arrive within {self.timeout_s:g} s "
                "(--request-body-timeout)"
            )
            return await _refuse(scope, receive, send, 408, message)
        except _ClientGone:
            return  # nobody to answer
        await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, scope, receive, send) -> None:
        message = f"the request body is larger than {self.max_size} bytes (--max-request-body-size)"
        await _refuse(scope, receive, send, 413, message)

    async def _read(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_size:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """A ``receive`` giving ``body`` in one message, then whatever the server sends next."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
