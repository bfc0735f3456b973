"""AdminService's LoRA calls (LoadLoraAdapter, UnloadLoraAdapter, ListLoraAdapters) and the
conversion of the engine's adapter entries to protos. The engine core is the authority on which
adapters exist: the server asks it and maps its errors (``convert.engine_errors``)."""

from __future__ import annotations

import logging

from llmrpc.engine.lora.types import MAX_LORA_PATH_CHARS, check_adapter_name
from llmrpc.server import convert
from llmrpc.server.errors import InvalidArgument
from llmrpc.v1 import admin_pb2

logger = logging.getLogger(__name__)


def adapter_proto(entry: dict, hide_path: bool = False) -> admin_pb2.LoraAdapter:
    """``hide_path`` (--hide-model-path): the adapter's name stands for its folder."""
    path = entry["name"] if hide_path else entry["path"]
    return admin_pb2.LoraAdapter(
        name=entry["name"], path=path, base_model_name=entry["base_model_name"]
    )


def _check_request(request) -> None:
    with convert.engine_errors(request):
        check_adapter_name(request.lora_name)
    if hasattr(request, "lora_path"):
        if not request.lora_path:
            raise InvalidArgument("lora_path", "must not be empty")
        if len(request.lora_path) > MAX_LORA_PATH_CHARS:
            raise InvalidArgument("lora_path", f"at most {MAX_LORA_PATH_CHARS} characters")


async def load(engine, request, hide_path: bool = False) -> admin_pb2.LoadLoraAdapterResponse:
    _check_request(request)
    with convert.engine_errors(request):
        entry = await engine.load_lora_adapter(
            request.lora_name, request.lora_path, request.base_model_name
        )
    logger.info("LoRA adapter %r loaded from %s", request.lora_name, request.lora_path)
    return admin_pb2.LoadLoraAdapterResponse(adapter=adapter_proto(entry, hide_path))


async def unload(engine, request) -> admin_pb2.UnloadLoraAdapterResponse:
    _check_request(request)
    with convert.engine_errors(request):
        await engine.unload_lora_adapter(request.lora_name)
    logger.info("LoRA adapter %r unloaded", request.lora_name)
    return admin_pb2.UnloadLoraAdapterResponse()


async def list_adapters(engine, hide_path: bool = False) -> admin_pb2.ListLoraAdaptersResponse:
    entries = await engine.list_lora_adapters()
    adapters = [adapter_proto(entry, hide_path) for entry in entries]
    return admin_pb2.ListLoraAdaptersResponse(adapters=adapters)
