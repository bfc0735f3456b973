"""ASGI middleware of the gateway: API keys, request ids, the header-count limit, load tracking,
and the user's own (``--middleware``). Pure ASGI, so streamed responses pass through untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib
import inspect
import uuid

from fastapi import FastAPI

from llmrpc.clients.connection import acting_for, made_for
from llmrpc.gateway.errors import OpenAIError, invalid
from llmrpc.gateway.state import REQUEST_ID_HEADER, GatewayState
from llmrpc.v1.headers import bearer_key, request_id_problem

# Answered without an API key: probes and scrapers carry none.
# (KServe v2's health routes are probes as /health is.)
OPEN_PATHS = frozenset(
    {"/health", "/ping", "/version", "/metrics", "/v2/health/live", "/v2/health/ready"}
)
# Requests counted by --enable-server-load-tracking.
LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# X-Request-Id: at most 128 characters, half the gRPC bound, leaving room for the "-N" suffix
# the gateway gives each prompt of a batch.
MAX_REQUEST_ID_HEADER_LENGTH = 128
# The ASGI scope key holding the SHA-256 digest of the caller's API key (never the key itself):
# what the Responses store scopes its entries to.
KEY_DIGEST_SCOPE = "llmrpc.key_digest"


def _path(scope) -> str:
    root = scope.get("root_path", "")
    path = scope["path"]
    return path[len(root) :] if root and path.startswith(root) else path


async def _reply_error(scope, receive, send, error: OpenAIError, headers=()) -> None:
    response = error.response()
    response.raw_headers.extend(headers)
    await response(scope, receive, send)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def caller_key_digest(scope) -> bytes | None:
    """The digest of the key the caller presented; None on a gateway that takes no keys."""
    return scope.get(KEY_DIGEST_SCOPE)


class ApiKeyMiddleware:
    """Every path but ``OPEN_PATHS`` needs an ``Authorization`` header presenting one of the keys,
    by the rule gRPC follows too (``llmrpc.v1.headers.bearer_key``: RFC 7235's ``Bearer KEY``).

    ``forward_key``: the gRPC calls made for the request carry the caller's own key, so the
    server authorizes the caller (whose key it knows: ``llmrpc serve``) rather than the gateway.
    The digest of the caller's key goes into the scope (``caller_key_digest``).
    """

    def __init__(self, app, keys: tuple[str, ...], forward_key: bool = False) -> None:
        self.app = app
        self.digests = [key_digest(key) for key in keys]
        self.forward_key = forward_key

    def _known(self, digest: bytes) -> bool:
        # Each key compared in constant time over equal-length digests; all of them, always.
        return any([hmac.compare_digest(digest, known) for known in self.digests])

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or _path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        key = bearer_key(dict(scope["headers"]).get(b"authorization"))
        digest = None if key is None else key_digest(key)
        if digest is not None and self._known(digest):
            scope[KEY_DIGEST_SCOPE] = digest
            forwarding = acting_for(key) if self.forward_key else contextlib.nullcontext()
            with forwarding:
                return await self.app(scope, receive, send)
        error = OpenAIError(401, "Unauthorized: send 'Authorization: Bearer <api key>'")
        await _reply_error(scope, receive, send, error, [(b"www-authenticate", b"Bearer")])


class ClientMiddleware:
    """The gRPC calls made for a request say which REST connection they are for
    (``llmrpc.v1.headers.CLIENT``), so ``llmrpc serve``'s engine lets REST callers without keys
    take turns by connection, as it does gRPC callers (a key, when there is one, comes first)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host, port = scope.get("client") or ("unix", 0)
        with made_for(f"{host}:{port}"):
            return await self.app(scope, receive, send)


class RequestIdMiddleware:
    """A caller's ``X-Request-Id`` must be 1 to ``MAX_REQUEST_ID_HEADER_LENGTH`` visible ASCII
    characters (else 400 naming the header: it goes into logs and the gRPC request id).

    ``echo``: ``X-Request-Id`` on every response, the caller's, else a new one (which the request
    then carries too, so the gRPC request gets the same id)."""

    def __init__(self, app, echo: bool = True) -> None:
        self.app = app
        self.echo = echo

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = REQUEST_ID_HEADER.encode()
        value = dict(scope["headers"]).get(header)
        if value and (problem := _request_id_problem(value)):  # empty: as if absent
            error = invalid(REQUEST_ID_HEADER, f"{REQUEST_ID_HEADER} header: {problem}")
            return await _reply_error(scope, receive, send, error)
        if not self.echo:
            return await self.app(scope, receive, send)
        if not value:
            value = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*scope["headers"], (header, value)]}

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (header, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _request_id_problem(value: bytes) -> str | None:
    text = value.decode("latin-1")  # any non-ASCII byte stays non-ASCII, and is refused
    return request_id_problem(text, MAX_REQUEST_ID_HEADER_LENGTH)


class HeaderCountMiddleware:
    """Refuses requests with more header fields than ``--h11-max-header-count`` (431)."""

    def __init__(self, app, max_headers: int) -> None:
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > self.max_headers:
            message = f"too many header fields: at most {self.max_headers}"
            return await _reply_error(scope, receive, send, OpenAIError(431, message))
        await self.app(scope, receive, send)


class LoadTrackingMiddleware:
    """Counts generation requests in flight, streams until their last byte (``GET /load``)."""

    def __init__(self, app, gateway: GatewayState) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _path(scope) not in LOAD_PATHS:
            return await self.app(scope, receive, send)
        self.gateway.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gateway.server_load -= 1


def add_user_middleware(app: FastAPI, import_path: str) -> None:
    """``--middleware module.name``: a class is added as ASGI middleware, a coroutine function
    as an HTTP middleware ``(request, call_next)``."""
    module_name, _, attribute = import_path.rpartition(".")
    if not module_name:
        raise ValueError(f"--middleware {import_path}: give an import path, module.name")
    try:
        middleware = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--middleware {import_path}: cannot import it: {error}") from None
    if inspect.isclass(middleware):
        app.add_middleware(middleware)
    elif inspect.iscoroutinefunction(middleware):
        app.middleware("http")(middleware)
    else:
        raise ValueError(f"--middleware {import_path}: not a class or an async function")
