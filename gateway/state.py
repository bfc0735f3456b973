"""What every route of one gateway shares: its settings, replicas, metrics and load counter."""

from __future__ import annotations

import uuid

from fastapi import Request

from llmrpc.clients import LlmrpcError
from llmrpc.gateway.backends import BackendPool
from llmrpc.gateway.metrics import GatewayMetrics
from llmrpc.gateway.settings import GatewaySettings

REQUEST_ID_HEADER = "x-request-id"


class GatewayState:
    def __init__(self, settings: GatewaySettings, channels=None) -> None:
        self.settings = settings
        self.api = settings.api
        self.pool = BackendPool(settings.backends, channels)
        self.metrics = GatewayMetrics()
        self.server_load = 0  # requests in flight (--enable-server-load-tracking)
        self._max_list_items: int | None = None

    async def max_list_items(self) -> int | None:
        """The longest list a request can usefully carry: the served model's context length or
        vocabulary size, whichever is larger (None while no replica answers)."""
        if self._max_list_items is None:
            try:
                info = await self.pool.call("model_info")
            except LlmrpcError:
                return None
            self._max_list_items = max(info.max_model_len, info.vocab_size)
        return self._max_list_items

    async def model_name(self, requested: str | None) -> str:
        """The name a response reports: the one asked for, else the default model's."""
        if not self.metrics.model_name:
            self.metrics.model_name = await self.pool.default_model()
        return requested or self.metrics.model_name

    def grpc_model(self, requested: str | None) -> dict[str, str]:
        """The gRPC fields an OpenAI ``model`` sets: ``model``, which names a served model or a
        loaded LoRA adapter; the server resolves it (NOT_FOUND naming ``model`` and what is
        served, if neither)."""
        return {"model": requested or ""}


def gateway_of(request: Request) -> GatewayState:
    return request.app.state.gateway


def request_id(request: Request) -> str:
    """The caller's ``X-Request-Id``, else a new one; it is also the gRPC request id."""
    return request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
