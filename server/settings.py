"""Frontend settings: where the server listens, TLS, API keys, transport limits and logging.

Frozen dataclasses built once from the command line (see ``options``); bad values raise
``ValueError`` naming the flag. Defaults here are the flags' defaults.

The REST gateway's part is the gateway's own settings (``common.rest_settings``: the listener,
CORS, the API), filled by the REST flags declared there; ``llmrpc.cli.rest`` completes them
with what serve shares between gRPC and REST (host, TLS, keys, limits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmrpc.common.fanout import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    check_fanout_flags,
)
from llmrpc.common.rest_settings import MIB, ApiSettings, CorsSettings, HttpSettings
from llmrpc.common.tls_files import check_tls_flags
from llmrpc.server.tracing_config import TracingConfig

DEFAULT_GRPC_PORT = 50051
# The sections of FrontendConfig that the REST flags fill: the gateway's settings classes.
REST_SECTIONS: dict[str, type] = {
    "rest_http": HttpSettings,
    "rest_cors": CorsSettings,
    "rest_api": ApiSettings,
}


def _check_port(flag: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise ValueError(f"{flag} must be a port number in [0, 65535], got {value}")


def _check_positive(flag: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{flag} must be positive, got {value}")


@dataclass(frozen=True)
class TLSConfig:
    """``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``, ``--ssl-cert-reqs``,
    ``--enable-ssl-refresh``."""

    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0
    refresh: bool = False

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    def __post_init__(self) -> None:
        check_tls_flags(self.keyfile, self.certfile, self.ca_certs, self.cert_reqs, self.refresh)


@dataclass(frozen=True)
class LimitsConfig:
    """Transport limits (our flags): message sizes, keepalive, connection age, streams, queue."""

    max_receive_message_size: int = 16 * MIB
    max_send_message_size: int = 16 * MIB
    keepalive_time_s: float = 60.0  # the server pings an idle connection this often...
    keepalive_timeout_s: float = 20.0  # ...and closes it if the ping is not answered in time
    min_ping_interval_s: float = 10.0  # a client pinging more often is disconnected
    max_connection_age_s: float | None = None
    max_connection_age_grace_s: float | None = None
    # A connection's streams at once: as many as a batch holds by default (--max-num-seqs).
    max_concurrent_streams: int = 256
    max_connections: int | None = None  # None: a quarter of the open-file limit
    handshake_timeout_s: float = 10.0  # a new connection's TLS and HTTP/2 handshake
    request_message_timeout_s: float = 30.0  # a call's request message, from its headers
    max_waiting_requests: int | None = None  # None: the waiting queue is unbounded
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # common/fanout.py
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST  # prompts x n

    def __post_init__(self) -> None:
        for flag, value in (
            ("--grpc-max-receive-message-size", self.max_receive_message_size),
            ("--grpc-max-send-message-size", self.max_send_message_size),
            ("--grpc-keepalive-time", self.keepalive_time_s),
            ("--grpc-keepalive-timeout", self.keepalive_timeout_s),
            ("--grpc-keepalive-min-ping-interval", self.min_ping_interval_s),
            ("--grpc-max-connection-age", self.max_connection_age_s),
            ("--grpc-max-connection-age-grace", self.max_connection_age_grace_s),
            ("--grpc-max-concurrent-streams", self.max_concurrent_streams),
            ("--grpc-max-connections", self.max_connections),
            ("--grpc-handshake-timeout", self.handshake_timeout_s),
            ("--grpc-request-message-timeout", self.request_message_timeout_s),
        ):
            _check_positive(flag, value)
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(
                f"--max-waiting-requests must be 0 or more, got {self.max_waiting_requests}"
            )
        check_fanout_flags(self.max_prompts_per_request, self.max_sequences_per_request)


@dataclass(frozen=True)
class LogConfig:
    """Logging: level, a dictConfig file, request and output lines, the periodic stats line."""

    level: str = "info"
    config_file: str | None = None
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: int | None = None  # None: whole prompts and outputs
    disable_log_stats: bool = False
    stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be 0 or more, got {self.max_log_len}")
        _check_positive("--log-stats-interval", self.stats_interval_s)


@dataclass(frozen=True)
class ParsingConfig:
    """Parsing of chat outputs: tool calls (``--enable-auto-tool-choice``, ``--tool-call-parser``,
    ``--tool-parser-plugin``, ``--exclude-tools-when-tool-choice-none``) and reasoning
    (``--reasoning-parser``, ``--reasoning-parser-plugin``). Parser names are checked against
    the registries once the plugins are loaded (``output_parsing.OutputParsers``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    tool_parser_plugin: str = ""  # a Python file registering tool parsers; "": none
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str = ""  # "": outputs are not split
    reasoning_parser_plugin: str = ""

    def __post_init__(self) -> None:
        # As vLLM: auto tool choice is nothing without a parser to read the calls.
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


@dataclass(frozen=True)
class FrontendConfig:
    """Everything about the gRPC server that is not the engine."""

    host: str | None = None  # None: all addresses
    grpc_port: int = DEFAULT_GRPC_PORT
    health_port: int | None = None  # a plaintext port serving health alone (Kubernetes probes)
    api_key: tuple[str, ...] = ()
    admin_api_key: tuple[str, ...] = ()  # needed for admin-only RPCs (server/auth.py)
    chat_template: str | None = None  # a file, or the template itself
    trust_request_chat_template: bool = False  # else requests may not bring their own
    hide_model_path: bool = False  # --hide-model-path: names, not folders (server/model_paths.py)
    drain_delay_s: float = 0.0
    shutdown_grace_s: float = 10.0
    # Health NOT_SERVING once the engine has had requests in flight and not stepped this long
    # (--engine-stall-timeout; server/health.py). Longer than any legitimate step: a full
    # 2048-token prefill of SmolLM2-135M (Transformers) took 12 s in float32 on 2 shared cores.
    engine_stall_timeout_s: float = 60.0
    # Where the engine core runs: in a process of its own (False, the default, as vLLM's), or
    # on a thread of the server's process (True: --disable-frontend-multiprocessing)
    disable_frontend_multiprocessing: bool = False
    # Engine processes behind this frontend (--data-parallel-size; engine/client/data_parallel.py)
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None  # accepted only equal to data_parallel_size
    tls: TLSConfig = field(default_factory=TLSConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    logs: LogConfig = field(default_factory=LogConfig)
    rest_gateway: bool = True  # --rest-gateway: the REST gateway runs beside the gRPC server
    # The gateway's settings as the REST flags set them (host, TLS, keys and limits unset)
    rest_http: HttpSettings = field(default_factory=HttpSettings)
    rest_cors: CorsSettings = field(default_factory=CorsSettings)
    rest_api: ApiSettings = field(default_factory=ApiSettings)
    parsing: ParsingConfig = field(default_factory=ParsingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        _check_port("--grpc-port", self.grpc_port)
        _check_port("--health-port", self.health_port)
        if any(not key for key in self.api_key):
            raise ValueError("--api-key must not be empty")
        if any(not key for key in self.admin_api_key):
            raise ValueError("--admin-api-key must not be empty")
        if set(self.api_key) & set(self.admin_api_key):
            raise ValueError("--admin-api-key: a key cannot be an --api-key too (keep them apart)")
        for flag, value in (
            ("--drain-delay", self.drain_delay_s),
            ("--shutdown-grace", self.shutdown_grace_s),
        ):
            if value < 0:
                raise ValueError(f"{flag} must be 0 or more, got {value}")
        _check_positive("--engine-stall-timeout", self.engine_stall_timeout_s)
        self._check_ports_apart()
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        size, local = self.data_parallel_size, self.data_parallel_size_local
        if size < 1:
            raise ValueError(f"--data-parallel-size must be 1 or more, got {size}")
        if local is not None and local != size:
            raise ValueError(
                f"--data-parallel-size-local {local} is refused: every engine of this server "
                f"runs on this machine, so it can only equal --data-parallel-size ({size}); "
                "for several machines run one server per machine behind Envoy or as "
                "Kubernetes replicas (docs/scaling.md)"
            )
        if size > 1 and self.disable_frontend_multiprocessing:
            raise ValueError(
                f"--data-parallel-size {size} needs each engine in a process of its own; "
                "drop --disable-frontend-multiprocessing"
            )

    def _check_ports_apart(self) -> None:
        """Two of our own listeners cannot share a port (0, the OS chooses, is never shared)."""
        ports = {"--grpc-port": self.grpc_port, "--health-port": self.health_port}
        if self.rest_gateway and self.rest_http.uds is None:
            ports["--port"] = self.rest_http.port
        seen: dict[int, str] = {}
        for flag, port in ports.items():
            if port and port in seen:
                raise ValueError(
                    f"{flag} {port} and {seen[port]} {port}: each listener needs a port of its own"
                )
            if port:
                seen[port] = flag


class BindError(RuntimeError):
    """A port could not be bound (in use, or a bad address)."""


def grpc_bind_address(host: str | None, port: int) -> str:
    """``host:port`` as gRPC wants it: all addresses is ``[::]``, IPv6 literals in brackets."""
    if not host:
        host = "[::]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
