"""What the services share: the engine and the frontend's tokenizers (None while the model
loads; the tokenizers are set first) and the server's facts."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmrpc.engine.lora.types import MAX_LORA_NAME_CHARS
from llmrpc.kserve import grpc_predict_v2_pb2
from llmrpc.server.auth import RequestOwners
from llmrpc.server.errors import NotFound, Unavailable
from llmrpc.server.limits import AdmissionControl
from llmrpc.server.output_parsing import OutputParsers
from llmrpc.server.settings import LogConfig
from llmrpc.v1 import admin_pb2, embedding_pb2, generation_pb2, tokenization_pb2
from llmrpc.vllm_engine import vllm_engine_pb2

if TYPE_CHECKING:
    from llmrpc.server.tokenization import Tokenization

API_VERSION = "v1"
SERVICE_NAMES = tuple(
    module.DESCRIPTOR.services_by_name[name].full_name
    for module, name in (
        (generation_pb2, "GenerationService"),
        (tokenization_pb2, "TokenizationService"),
        (admin_pb2, "AdminService"),
        (embedding_pb2, "EmbeddingService"),
        (grpc_predict_v2_pb2, "GRPCInferenceService"),  # KServe v2 (server/kserve.py)
        (vllm_engine_pb2, "VllmEngine"),  # vLLM's, as the smg router calls it (vllm_engine.py)
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
    hide_model_path: bool = False  # --hide-model-path (server/model_paths.py)
    output_parsers: OutputParsers = field(default_factory=OutputParsers)  # tools, reasoning
    lora_enabled: bool = False  # --enable-lora: ``model`` may name a loaded adapter
    tokenization: Tokenization | None = None  # set before ``engine``: an engine has one
    tokenizer_path: str | None = None  # the folder (or name) the tokenizer was loaded from
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
            raise model_not_found(requested, names)
        return requested

    def model_target(self, requested: str, lora: str = "") -> tuple[str, str | None]:
        """``(served name, adapter or None)`` for a request's ``model`` (and ``lora``): a served
        model's name, or, with --enable-lora and no ``lora`` set, a LoRA adapter's, which the
        engine resolves (``adapter_not_found`` then says what is served)."""
        names = self.require_engine().model_info.served_model_names
        if not requested or requested in names:
            return requested or names[0], None
        if not self.lora_enabled or lora or len(requested) > MAX_LORA_NAME_CHARS:
            raise model_not_found(requested, names)
        return names[0], requested

    async def adapter_not_found(self, engine, requested: str) -> NotFound:
        """NOT_FOUND for a ``model`` that is neither a served model nor a loaded adapter."""
        adapters = [adapter["name"] for adapter in await engine.list_lora_adapters()]
        return model_not_found(requested, engine.model_info.served_model_names, adapters)


def model_not_found(requested: str, served, adapters: list[str] | None = None) -> NotFound:
    """NOT_FOUND naming the field ``model`` and what is served: the served models, and with
    ``adapters`` (--enable-lora) the loaded LoRA adapters. Worded as OpenAI's ``model_not_found``
    (the REST gateway answers it as such)."""
    description = f"The model `{requested}` does not exist. Served models: {_quoted(served)}"
    if adapters is not None:
        description += f"; loaded LoRA adapters: {_quoted(adapters) if adapters else 'none'}"
    return NotFound("model", requested, "model", description + ".")


def _quoted(names) -> str:
    return ", ".join(f"`{name}`" for name in names)
