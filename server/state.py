"""What the services share: the engine (None while the model loads) and the server's facts."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

from llmrpc.server.auth import RequestOwners
from llmrpc.server.errors import NotFound, Unavailable
from llmrpc.server.limits import AdmissionControl
from llmrpc.server.output_parsing import OutputParsers
from llmrpc.server.settings import LogConfig
from llmrpc.v1 import admin_pb2, embedding_pb2, generation_pb2, tokenization_pb2

API_VERSION = "v1"
SERVICE_NAMES = tuple(
    module.DESCRIPTOR.services_by_name[name].full_name
    for module, name in (
        (generation_pb2, "GenerationService"),
        (tokenization_pb2, "TokenizationService"),
        (admin_pb2, "AdminService"),
        (embedding_pb2, "EmbeddingService"),
    )
)


def server_version() -> str:
    try:
        return importlib.metadata.version("llmrpc")
    except importlib.metadata.PackageNotFoundError:  # running from a tree that is not installed
        return "0+unknown"


@dataclass
class ServerState:
    effective_config: dict[str, str] = field(default_factory=dict)
    tls: bool = False
    auth_required: bool = False
    admin_auth_required: bool = False  # --admin-api-key set (server/auth.py)
    extra_services: tuple[str, ...] = ()  # health, reflection: listed in GetServerInfo
    logs: LogConfig = field(default_factory=LogConfig)
    admission: AdmissionControl = field(default_factory=lambda: AdmissionControl(None))
    owners: RequestOwners = field(default_factory=RequestOwners)  # who started each live call
    trust_request_chat_template: bool = False  # --trust-request-chat-template
    output_parsers: OutputParsers = field(default_factory=OutputParsers)  # tools, reasoning
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
