"""Settings of the OpenAI-compatible REST gateway: the listener, CORS and the API; frozen
dataclasses built once from a command line (``llmrpc gateway``, or ``llmrpc serve`` for the
gateway it runs beside its gRPC server). Bad values raise ``ValueError`` naming the flag.

Each field a REST flag fills declares that flag (``rest_options.option``): name, default,
value parser, help. Both commands build their REST flags from these declarations, so each
option and its default are written here alone. The flag names and defaults are vLLM's
(``vllm serve``), so a command line moves over unchanged. The fields without a flag here are
set by each command from flags of its own (``--host``, the TLS files, the API keys...), which
``llmrpc serve`` shares with its gRPC server.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmrpc.common.fanout import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    check_fanout_flags,
)
from llmrpc.common.rest_options import human_readable_int, json_list, option
from llmrpc.common.tls_files import check_tls_flags
from llmrpc.common.tracing import check_endpoint

MIB = 1024 * 1024
CONTENT_FORMATS = ("auto", "string", "openai")
# The gRPC servers' default receive limit (--grpc-max-receive-message-size): a larger body
# could not reach them anyway.
DEFAULT_MAX_REQUEST_BODY_SIZE = 16 * MIB
# The Responses API's store (--responses-store-max-bytes): some thousands of typical responses.
DEFAULT_RESPONSES_STORE_MAX_BYTES = 256 * MIB
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class HttpSettings:
    """The REST listener: address, TLS, HTTP/1.1 limits, uvicorn's logging."""

    host: str | None = None  # None: all addresses
    port: int = option(
        "--port",
        8000,
        int,
        "Port of the OpenAI-compatible REST gateway (0: the OS chooses; the log says which).",
    )
    uds: str | None = option(
        "--uds", None, str, "Serve the REST gateway on this Unix socket instead of --host/--port."
    )
    root_path: str | None = option(
        "--root-path", None, str, "Path prefix a path-routing proxy strips before the REST gateway."
    )
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # 0 none, 1 optional, 2 required (mutual TLS)
    enable_ssl_refresh: bool = False
    h11_max_incomplete_event_size: int = option(
        "--h11-max-incomplete-event-size",
        4194304,
        int,
        "Largest unfinished HTTP/1.1 request head in bytes on the REST gateway.",
    )
    h11_max_header_count: int = option(
        "--h11-max-header-count",
        256,
        int,
        "Most header fields in a REST request; more get HTTP 431.",
    )
    uvicorn_log_level: str = option(
        "--uvicorn-log-level",
        "info",
        str,
        "Log level of the REST gateway's HTTP server (uvicorn).",
        choices=UVICORN_LOG_LEVELS,
    )
    disable_uvicorn_access_log: bool = option(
        "--disable-uvicorn-access-log", False, None, "No access log line per REST request."
    )
    # None: the gRPC receive limit (llmrpc serve's; llmrpc gateway: DEFAULT_MAX_REQUEST_BODY_SIZE)
    max_request_body_size: int | None = option(
        "--max-request-body-size",
        None,
        human_readable_int,
        "Largest REST request body in bytes (16M = 16 MiB); a larger one gets HTTP 413, refused "
        "by its Content-Length or as it arrives. Default: --grpc-max-receive-message-size "
        "(llmrpc gateway: 16 MiB, the gRPC servers' default).",
        metavar="BYTES",
        ours=True,
    )
    request_body_timeout_s: float = option(
        "--request-body-timeout",
        30.0,
        float,
        "Seconds a REST request body has to arrive in full; a slower one gets HTTP 408, so a "
        "client trickling its body cannot hold a connection.",
        metavar="SECONDS",
        ours=True,
    )
    max_connections: int | None = option(
        "--rest-max-connections",
        None,
        int,
        "Most connections the REST gateway holds at once; more are closed as they are "
        "accepted, before a byte is read. Default: a quarter of the process's open-file limit "
        "(raised to its hard limit at start-up).",
        metavar="N",
        ours=True,
    )
    header_timeout_s: float = option(
        "--request-header-timeout",
        10.0,
        float,
        "Seconds a new REST connection has to finish its TLS handshake, then each request "
        "head to arrive (from the connection's start or the previous response's end); an "
        "unfinished head gets HTTP 408 and the connection closes.",
        metavar="SECONDS",
        ours=True,
    )
    keep_alive_timeout_s: float = option(
        "--rest-keep-alive-timeout",
        5.0,
        float,  # uvicorn's
        "Seconds a REST connection may stay idle after a response before it is closed.",
        metavar="SECONDS",
        ours=True,
    )

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
            ("--max-request-body-size", self.body_limit),
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

    @property
    def body_limit(self) -> int:
        """Bytes a request body may have: --max-request-body-size, else the gRPC servers'
        default receive limit (``llmrpc serve`` sets its own limit here)."""
        size = self.max_request_body_size
        return DEFAULT_MAX_REQUEST_BODY_SIZE if size is None else size


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...] = option(
        "--allowed-origins",
        ["*"],
        json_list,
        "CORS: origins allowed on the REST gateway (a JSON list).",
    )
    allowed_methods: tuple[str, ...] = option(
        "--allowed-methods",
        ["*"],
        json_list,
        "CORS: methods allowed on the REST gateway (a JSON list).",
    )
    allowed_headers: tuple[str, ...] = option(
        "--allowed-headers",
        ["*"],
        json_list,
        "CORS: headers allowed on the REST gateway (a JSON list).",
    )
    allow_credentials: bool = option(
        "--allow-credentials", False, None, "CORS: allow credentials on the REST gateway."
    )


@dataclass(frozen=True)
class ApiSettings:
    """What the OpenAI API answers and how."""

    api_keys: tuple[str, ...] = ()  # REST callers must send one as "Authorization: Bearer KEY"
    chat_template: str | None = None  # a Jinja template, sent with every chat request
    chat_template_content_format: str = option(
        "--chat-template-content-format",
        "auto",
        str,
        "Message content given to chat templates: a string, or OpenAI's list of text parts; "
        "auto: parts for templates that loop over the content.",
        choices=CONTENT_FORMATS,
    )
    response_role: str = option(
        "--response-role",
        "assistant",
        str,
        "Role of REST chat answers when add_generation_prompt is true.",
    )
    return_tokens_as_token_ids: bool = option(
        "--return-tokens-as-token-ids", False, None, "REST logprob tokens written as token_id:N."
    )
    enable_prompt_tokens_details: bool = option(
        "--enable-prompt-tokens-details",
        False,
        None,
        "usage.prompt_tokens_details.cached_tokens in REST responses.",
    )
    enable_force_include_usage: bool = option(
        "--enable-force-include-usage",
        False,
        None,
        "REST streams end with a usage chunk even when the request does not ask.",
    )
    enable_tokenizer_info_endpoint: bool = option(
        "--enable-tokenizer-info-endpoint",
        False,
        None,
        "GET /get_tokenizer_info on the REST gateway.",
    )
    enable_server_load_tracking: bool = option(
        "--enable-server-load-tracking",
        False,
        None,
        "GET /load on the REST gateway: generation requests in flight there (AdminService "
        "GetLoad always reports the engine's load).",
    )
    enable_request_id_headers: bool = option(
        "--enable-request-id-headers",
        False,
        None,
        "X-Request-Id on REST responses (the caller's, else a new one: the gRPC request id).",
    )
    disable_fastapi_docs: bool = option(
        "--disable-fastapi-docs",
        False,
        None,
        "No OpenAPI schema, Swagger UI or ReDoc on the REST gateway.",
    )
    strict_request_fields: bool = option(
        "--strict-request-fields",
        False,
        None,
        "A REST request field this server does not know is a 400 naming it. Without this flag "
        "it is ignored, as vLLM ignores it, with a warning in the log (once a name every 10 "
        "minutes). Fields it knows and cannot honour are a 400 either way.",
        ours=True,
    )
    middleware: tuple[str, ...] = option(
        "--middleware",
        [],
        str,
        "Import path of an ASGI middleware class or async HTTP middleware function added to "
        "the REST gateway; several allowed.",
        nargs="+",
        repeatable=True,
    )
    otlp_traces_endpoint: str | None = None  # OpenTelemetry collector: a span per request
    responses_store_max_bytes: int = option(
        "--responses-store-max-bytes",
        DEFAULT_RESPONSES_STORE_MAX_BYTES,
        human_readable_int,
        "Bytes the Responses API's store may hold (256M = 256 MiB; 0: nothing is kept); past "
        "them the least recently used responses go first. Default: 256 MiB.",
        metavar="BYTES",
        ours=True,
    )
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
