"""ASGI middleware for the ``--middleware`` tests, imported by path as the flag does it."""

from __future__ import annotations


class TagResponses:
    """A class: added with ``app.add_middleware``; marks every response."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"x-tagged-by", b"class")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, tagged)


async def tag_with_function(request, call_next):
    """A coroutine function: added as an HTTP middleware."""
    response = await call_next(request)
    response.headers["x-tagged-by-function"] = "yes"
    return response


NOT_MIDDLEWARE = 42
