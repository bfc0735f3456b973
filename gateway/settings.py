"""Settings of the OpenAI-compatible gateway: frozen dataclasses built once from the command line
(``llmrpc gateway`` or ``llmrpc serve``). Bad values raise ``ValueError`` naming the flag.

The listener's, CORS's and the API's settings, with the REST flags declared on their fields,
are in ``common.rest_settings``: ``llmrpc serve``'s flag table reads them there without
importing the gateway. Here: how the gateway reaches its replicas, and the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmrpc.common.rest_settings import (
    CONTENT_FORMATS,
    DEFAULT_MAX_REQUEST_BODY_SIZE,
    DEFAULT_RESPONSES_STORE_MAX_BYTES,
    UVICORN_LOG_LEVELS,
    ApiSettings,
    CorsSettings,
    HttpSettings,
)

__all__ = [
    "CONTENT_FORMATS",
    "DEFAULT_MAX_REQUEST_BODY_SIZE",
    "DEFAULT_RESPONSES_STORE_MAX_BYTES",
    "UVICORN_LOG_LEVELS",
    "ApiSettings",
    "BackendSettings",
    "CorsSettings",
    "GatewaySettings",
    "HttpSettings",
]


@dataclass(frozen=True)
class BackendSettings:
    """How the gateway reaches its gRPC replicas."""

    targets: tuple[str, ...] = ("localhost:50051",)
    api_key: str | None = None  # sent to the replicas as "authorization: Bearer KEY"
    # Send each REST caller's own key instead (llmrpc serve: its server then authorizes the
    # caller, not the gateway); api_key stays for calls made for no caller (/metrics, health).
    forward_api_key: bool = False
    tls: bool = False
    ca_certs: str | None = None  # verifies the replicas' certificates
    client_cert: str | None = None  # for replicas that require client certificates
    client_key: str | None = None
    server_name: str | None = None  # expected in the replicas' certificates

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("--backend: give at least one gRPC replica (HOST:PORT)")


@dataclass(frozen=True)
class GatewaySettings:
    backends: BackendSettings = field(default_factory=BackendSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    cors: CorsSettings = field(default_factory=CorsSettings)
    api: ApiSettings = field(default_factory=ApiSettings)
