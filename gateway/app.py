"""The gateway's FastAPI application: the OpenAI routes (and KServe v2's) over the gRPC
replicas, with the middleware its settings ask for.

Middleware order, outermost first: CORS (so preflights and error replies carry its headers),
the header-count limit, request ids, tracing (``--otlp-traces-endpoint``), API keys (so no body
is read for a caller without one), the body-size limit and read timeout, load tracking,
``--middleware`` ones, then the request's policy for fields it does not know
(``--strict-request-fields``).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from llmrpc.gateway import (
    chat,
    completions,
    embeddings,
    kserve_routes,
    lora_routes,
    responses_api,
    routes,
)
from llmrpc.gateway.body_limit import BodyLimitMiddleware
from llmrpc.gateway.errors import install_handlers
from llmrpc.gateway.middleware import (
    ApiKeyMiddleware,
    ClientMiddleware,
    HeaderCountMiddleware,
    LoadTrackingMiddleware,
    RequestIdMiddleware,
    add_user_middleware,
)
from llmrpc.gateway.request_fields import UnknownFieldsMiddleware
from llmrpc.gateway.settings import GatewaySettings
from llmrpc.gateway.state import GatewayState
from llmrpc.gateway.tracing import GatewayTracing, TracingMiddleware

ROUTERS = (
    completions.router,
    chat.router,
    embeddings.router,
    responses_api.router,
    lora_routes.router,
    routes.router,
    kserve_routes.router,  # KServe v2 / Open Inference Protocol, Triton's generate extension
)


def route_paths() -> list[str]:
    """Every path the gateway can serve, as FastAPI writes them (``/v1/models/{model:path}``): its
    routers', the optional routes' and FastAPI's own (docs, OpenAPI schema). Envoy's routes to the
    gateway are made from this, so a new route cannot be missed there."""
    app = FastAPI()  # its own routes: the docs pages and the schema
    every = SimpleNamespace(enable_server_load_tracking=True, enable_tokenizer_info_endpoint=True)
    routes.add_optional_routes(app, every)
    # the routers are included without a prefix: their routes' paths are the served ones
    included = [route.path for router in ROUTERS for route in router.routes]
    return list(dict.fromkeys([*included, *(route.path for route in app.routes)]))


def create_app(settings: GatewaySettings, channels=None) -> FastAPI:
    """``channels``: see ``BackendPool``. Raises ValueError naming the flag for a
    ``--middleware`` that cannot be imported."""
    gateway = GatewayState(settings, channels)
    endpoint = settings.api.otlp_traces_endpoint
    tracing = GatewayTracing(endpoint) if endpoint else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.pool.start()
        if tracing is not None:
            tracing.start()
        try:
            yield
        finally:
            await gateway.pool.close()
            if tracing is not None:
                await tracing.stop()

    app = FastAPI(title="llmrpc OpenAI-compatible gateway", lifespan=lifespan, **_docs(settings))
    app.state.gateway = gateway
    install_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    routes.add_optional_routes(app, settings.api)
    _add_middleware(app, settings, gateway, tracing)
    return app


def _docs(settings: GatewaySettings) -> dict:
    options: dict = {}
    if settings.api.disable_fastapi_docs:
        options.update(openapi_url=None, docs_url=None, redoc_url=None)
    return options


def _add_middleware(
    app: FastAPI, settings: GatewaySettings, gateway: GatewayState, tracing: GatewayTracing | None
) -> None:
    api = settings.api
    app.add_middleware(UnknownFieldsMiddleware, strict=api.strict_request_fields)
    for import_path in api.middleware:
        add_user_middleware(app, import_path)
    if api.enable_server_load_tracking:
        app.add_middleware(LoadTrackingMiddleware, gateway=gateway)
    http = settings.http
    app.add_middleware(
        BodyLimitMiddleware,
        max_size=http.body_limit,
        timeout_s=http.request_body_timeout_s,
    )
    if settings.backends.forward_api_key:  # llmrpc serve's gateway: its server reads these
        app.add_middleware(ClientMiddleware)
    if api.api_keys:
        forward = settings.backends.forward_api_key
        app.add_middleware(ApiKeyMiddleware, keys=api.api_keys, forward_key=forward)
    if tracing is not None:  # inside the request-id check: a span for each well-formed id
        app.add_middleware(TracingMiddleware, tracing=tracing)
    # Always: a caller's X-Request-Id is checked whether or not responses echo one.
    app.add_middleware(RequestIdMiddleware, echo=api.enable_request_id_headers)
    app.add_middleware(HeaderCountMiddleware, max_headers=settings.http.h11_max_header_count)
    cors = settings.cors
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(cors.allowed_origins),
        allow_methods=list(cors.allowed_methods),
        allow_headers=list(cors.allowed_headers),
        allow_credentials=cors.allow_credentials,
    )
