"""The v1 gRPC services: thin handlers over ``AsyncEngine``; conversion lives in ``convert``.

A call whose client cancels or whose deadline passes has its handler task cancelled by grpc.aio;
``aclosing`` then closes the engine's output stream, which aborts the request and frees its KV
blocks at once.
"""

from __future__ import annotations

import importlib.metadata
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from llmrpc.server import convert
from llmrpc.server.errors import Internal, NotFound, Unavailable, handle_errors
from llmrpc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    tokenization_pb2,
    tokenization_pb2_grpc,
)

logger = logging.getLogger(__name__)

API_VERSION = "v1"
REQUEST_ID_METADATA = "x-request-id"
SERVICE_NAMES = tuple(
    module.DESCRIPTOR.services_by_name[name].full_name
    for module, name in (
        (generation_pb2, "GenerationService"),
        (tokenization_pb2, "TokenizationService"),
        (admin_pb2, "AdminService"),
    )
)


def server_version() -> str:
    try:
        return importlib.metadata.version("llmrpc")
    except importlib.metadata.PackageNotFoundError:  # running from a tree that is not installed
        return "0+unknown"


@dataclass
class ServerState:
    """What the services share: the engine (None while the model loads) and the server's facts."""

    effective_config: dict[str, str] = field(default_factory=dict)
    tls: bool = False
    auth_required: bool = False
    extra_services: tuple[str, ...] = ()  # health, reflection: listed in GetServerInfo
    engine: object | None = None

    def require_engine(self):
        engine = self.engine
        if engine is None:
            raise Unavailable("the model is still loading; retry once health reports SERVING")
        if engine.dead_error is not None:
            raise Unavailable(f"the engine has stopped and serves no requests: {engine.dead_error}")
        return engine

    def model_name(self, requested: str) -> str:
        """The served name a request's ``model`` field selects; empty selects the default."""
        names = self.require_engine().model_info.served_model_names
        if not requested:
            return names[0]
        if requested not in names:
            raise NotFound(
                "model",
                requested,
                "model",
                f"no model named {requested!r}; this server serves {', '.join(map(repr, names))}",
            )
        return requested


def request_id_of(request, context: grpc.aio.ServicerContext) -> str:
    """The request's own id, else the ``x-request-id`` metadata, else a new one."""
    if request.request_id:
        return request.request_id
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA and value:
            return value
    return uuid.uuid4().hex


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def _prepare(self, request, context):
        engine = self.state.require_engine()
        request_id = request_id_of(request, context)
        await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
        self.state.model_name(request.model)
        prompt, params = convert.to_engine_request(request, engine.tokenizer, engine.model_info)
        return engine, request_id, prompt, params

    @handle_errors
    async def Generate(self, request, context):
        engine, request_id, prompt, params = await self._prepare(request, context)
        total = None
        with convert.engine_errors(request):
            async with aclosing(engine.generate(request_id, prompt, params)) as outputs:
                async for output in outputs:
                    total = convert.merge_outputs(total, output)
        _raise_engine_failure(request_id, total)
        return convert.to_generate_response(request_id, total)

    @handle_errors
    async def GenerateStream(self, request, context):
        engine, request_id, prompt, params = await self._prepare(request, context)
        with convert.engine_errors(request):
            async with aclosing(engine.generate(request_id, prompt, params)) as outputs:
                async for output in outputs:
                    _raise_engine_failure(request_id, output)
                    await context.write(convert.to_generate_response(request_id, output))


def _raise_engine_failure(request_id: str, output) -> None:
    message = convert.engine_failure(output)
    if message is not None:
        logger.error("request %s failed in the engine: %s", request_id, message)
        raise Internal(f"the engine failed while serving request {request_id}: {message}")


class TokenizationServicer(tokenization_pb2_grpc.TokenizationServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    @handle_errors
    async def Tokenize(self, request, context):
        engine = self.state.require_engine()
        self.state.model_name(request.model)
        return convert.tokenize(request, engine.tokenizer, engine.model_info)

    @handle_errors
    async def Detokenize(self, request, context):
        engine = self.state.require_engine()
        self.state.model_name(request.model)
        return convert.detokenize(request, engine.tokenizer, engine.model_info)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    @handle_errors
    async def GetServerInfo(self, request, context):
        state = self.state
        engine = state.engine
        capabilities = admin_pb2.ServerCapabilities(
            tls=state.tls,
            auth_required=state.auth_required,
            prefix_caching=state.effective_config.get("enable_prefix_caching") == "True",
            device=getattr(engine.model_info, "device", "cpu") if engine is not None else "",
            services=[*SERVICE_NAMES, *state.extra_services],
        )
        return admin_pb2.GetServerInfoResponse(
            version=server_version(),
            api_version=API_VERSION,
            capabilities=capabilities,
            config=state.effective_config,
        )

    @handle_errors
    async def GetModelInfo(self, request, context):
        name = self.state.model_name(request.model)
        return convert.model_info_response(name, self.state.require_engine().model_info)

    @handle_errors
    async def ListModels(self, request, context):
        return convert.list_models_response(self.state.require_engine().model_info)

    @handle_errors
    async def Abort(self, request, context):
        engine = self.state.require_engine()
        aborted = await engine.abort(list(request.request_ids))
        if aborted:
            logger.info("aborted %d request(s): %s", len(aborted), ", ".join(aborted))
        return admin_pb2.AbortResponse(aborted_request_ids=aborted)


def add_services(server: grpc.aio.Server, state: ServerState) -> None:
    """Register the three v1 services on ``server``."""
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(state), server)
    tokenization_pb2_grpc.add_TokenizationServiceServicer_to_server(
        TokenizationServicer(state), server
    )
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(state), server)
