"""Settings of the OpenAI-compatible gateway: frozen dataclasses built once from the command line
(``llmrpc gateway`` or ``llmrpc serve``). Bad values raise ``ValueError`` naming the flag.

The flag names and defaults are vLLM's (``vllm serve``), so a command line moves over unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmrpc.common.fanout import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    check_fanout_flags,
)
from llmrpc.common.tls_files import check_tls_flags
from llmrpc.common.tracing import check_endpoint

CONTENT_FORMATS = ("auto", "string", "openai")
# The gRPC servers' default receive limit (--grpc-max-receive-message-size): a larger body
# could not reach them anyway.
DEFAULT_MAX_REQUEST_BODY_SIZE = 16 * 1024 * 1024
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0  # uvicorn's
# The Responses API's store (--responses-store-max-bytes): some thousands of typical responses.
DEFAULT_RESPONSES_STORE_MAX_BYTES = 256 * 1024 * 1024
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
class HttpSettings:
    """The REST listener: address, TLS, HTTP/1.1 limits, uvicorn's logging."""

    host: str | None = None  # None: all addresses
    port: int = 8000
    uds: str | None = None  # a Unix socket path instead of host/port
    root_path: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # 0 none, 1 optional, 2 required (mutual TLS)
    enable_ssl_refresh: bool = False
    h11_max_incomplete_event_size: int = 4194304
    h11_max_header_count: int = 256
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    max_request_body_size: int = DEFAULT_MAX_REQUEST_BODY_SIZE  # bytes; larger bodies get 413
    request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S  # slower bodies get 408
    max_connections: int | None = None  # None: a quarter of the open-file limit
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # handshake and each request head
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S  # idle after a response

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be a port number in [0, 65535], got {self.port}")
        check_tls_flags(
            self.ssl_keyfile,
            self.ssl_certfile,
            self.ssl_ca_certs,
            self.ssl_cert_reqs,
            self.enable_ssl_refresh,
        )
        for flag, value in (
            ("--h11-max-incomplete-event-size", self.h11_max_incomplete_event_size),
            ("--h11-max-header-count", self.h11_max_header_count),
            ("--max-request-body-size", self.max_request_body_size),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        for flag, seconds in (
            ("--request-body-timeout", self.request_body_timeout_s),
            ("--request-header-timeout", self.header_timeout_s),
            ("--rest-keep-alive-timeout", self.keep_alive_timeout_s),
        ):
            if not seconds > 0:
                raise ValueError(f"{flag} must be positive, got {seconds}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(
                f"--rest-max-connections must be at least 1, got {self.max_connections}"
            )
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class ApiSettings:
    """What the OpenAI API answers and how."""

    api_keys: tuple[str, ...] = ()  # REST callers must send one as "Authorization: Bearer KEY"
    chat_template: str | None = None  # a Jinja template, sent with every chat request
    chat_template_content_format: str = "auto"
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_server_load_tracking: bool = False
    enable_request_id_headers: bool = False
    disable_fastapi_docs: bool = False
    middleware: tuple[str, ...] = ()  # import paths of ASGI middleware
    otlp_traces_endpoint: str | None = None  # OpenTelemetry collector: a span per request
    responses_store_max_bytes: int = DEFAULT_RESPONSES_STORE_MAX_BYTES
    # One request's prompts, and prompts x n (common/fanout.py)
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST

    def __post_init__(self) -> None:
        check_fanout_flags(self.max_prompts_per_request, self.max_sequences_per_request)
        if any(not key for key in self.api_keys):
            raise ValueError("--api-key must not be empty")
        store_bytes = self.responses_store_max_bytes
        if store_bytes < 0:
            raise ValueError(f"--responses-store-max-bytes must be 0 or more, got {store_bytes}")
        check_endpoint("--otlp-traces-endpoint", self.otlp_traces_endpoint)
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"--chat-template-content-format must be one of {', '.join(CONTENT_FORMATS)}"
            )


@dataclass(frozen=True)
class GatewaySettings:
    backends: BackendSettings = field(default_factory=BackendSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    cors: CorsSettings = field(default_factory=CorsSettings)
    api: ApiSettings = field(default_factory=ApiSettings)
