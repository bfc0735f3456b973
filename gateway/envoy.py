"""An Envoy v3 bootstrap in front of llmrpc: native gRPC, the same API as JSON, the OpenAI API.

One listener (plain, TLS or mTLS) routes
- native gRPC (and grpc.health.v1, reflection) to the replicas over HTTP/2, health-checked with
  grpc.health.v1 and balanced by least requests;
- the native REST paths of the protos' ``google.api.http`` bindings (``POST /v1/generate``...)
  through ``grpc_json_transcoder`` to the same replicas; the streaming method as SSE events;
- the OpenAI paths (``/v1/chat/completions``...) to the REST gateway, with the transcoder off.
Every route is stream-safe: no route timeout (a generation may stream for minutes), but the
client's ``grpc-timeout`` is honoured.
"""

from __future__ import annotations

import base64
import ipaddress
from dataclasses import dataclass, field

from llmrpc.gateway.descriptors import api_descriptor_set_bytes, api_service_names
from llmrpc.gateway.envoy_tls import FrontTls, UpstreamTls, front_tls_socket, upstream_tls_socket

GRPC_CLUSTER = "llmrpc_grpc"
GATEWAY_CLUSTER = "llmrpc_gateway"
TRANSCODER = "envoy.filters.http.grpc_json_transcoder"
CORS = "envoy.filters.http.cors"
_API = "type.googleapis.com/envoy."


# A call that never reached a replica, or that a replica refused before starting it (UNAVAILABLE:
# stopping or not loaded; RESOURCE_EXHAUSTED: its queue is full), goes to another replica. Envoy
# never retries once a response has begun.
GRPC_RETRY_POLICY = {
    "retry_on": "connect-failure,refused-stream,unavailable,resource-exhausted",
    "num_retries": 2,
    "retry_host_predicate": [
        {
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3."
                "PreviousHostsPredicate"
            },
        }
    ],
    "host_selection_retry_max_attempts": 3,
}

CORS_ALLOW_HEADERS = "authorization, content-type, x-request-id, grpc-timeout, x-user-agent"
CORS_EXPOSE_HEADERS = "grpc-status, grpc-message, grpc-status-details-bin, x-request-id"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, flag: str) -> Endpoint:
        """``HOST:PORT`` or ``[IPV6]:PORT``."""
        host, _, port = text.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"{flag} {text!r}: expected HOST:PORT")
        return cls(host, int(port))

    @property
    def is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def to_envoy(self) -> dict:
        return {"socket_address": {"address": self.host, "port_value": self.port}}


@dataclass(frozen=True)
class HealthCheck:
    """Active health checks of each replica (grpc.health.v1) and gateway (HTTP GET)."""

    service_name: str = ""  # "" is the whole server; or e.g. llmrpc.v1.GenerationService
    interval_s: float = 5.0
    timeout_s: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    gateway_path: str = "/health"

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("--health-check-interval and --health-check-timeout must be > 0")
        if self.unhealthy_threshold < 1 or self.healthy_threshold < 1:
            raise ValueError("--unhealthy-threshold and --healthy-threshold must be 1 or more")


@dataclass(frozen=True)
class EnvoyOptions:
    backends: tuple[Endpoint, ...]
    gateways: tuple[Endpoint, ...] = ()
    listen: Endpoint = Endpoint("0.0.0.0", 8080)
    admin_port: int = 9901
    front_tls: FrontTls | None = None
    upstream_tls: UpstreamTls | None = None
    health_check: HealthCheck = field(default_factory=HealthCheck)
    cors_origins: tuple[str, ...] = ()
    descriptor_path: str | None = None  # None: the descriptor set goes inline
    stream_idle_timeout_s: float = 300.0
    max_requests: int = 4096
    # Below this share of healthy replicas Envoy would route to unhealthy ones too; but a
    # NOT_SERVING replica is loading (it answers UNAVAILABLE) or draining: 0 turns that off.
    panic_threshold_percent: float = 0.0
    upstream_keepalive_s: float = 30.0  # above the servers' least ping interval (10 s)

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("--backend: at least one gRPC replica is needed")
        if not 0 <= self.admin_port <= 65535:
            raise ValueError(f"--admin-port {self.admin_port}: not a port number")
        if not 0 <= self.panic_threshold_percent <= 100:
            raise ValueError("--panic-threshold must be a percentage, 0 to 100")
        if self.max_requests < 1 or self.stream_idle_timeout_s < 0:
            raise ValueError("--max-requests must be 1 or more, --stream-idle-timeout 0 or more")


def seconds(value: float) -> str:
    """A protobuf Duration as Envoy's YAML takes it."""
    return f"{value:.3f}s"


def build_bootstrap(options: EnvoyOptions) -> dict:
    clusters = [grpc_cluster(options)]
    if options.gateways:
        clusters.append(gateway_cluster(options))
    admin_address = Endpoint("127.0.0.1", options.admin_port).to_envoy()
    return {
        "admin": {"address": admin_address},
        "static_resources": {"listeners": [front_listener(options)], "clusters": clusters},
    }


def front_listener(options: EnvoyOptions) -> dict:
    chain: dict = {"filters": [connection_manager(options)]}
    if options.front_tls is not None:
        chain["transport_socket"] = front_tls_socket(options.front_tls)
    return {"name": "front", "address": options.listen.to_envoy(), "filter_chains": [chain]}


def connection_manager(options: EnvoyOptions) -> dict:
    virtual_host: dict = {"name": "llmrpc", "domains": ["*"], "routes": routes(options)}
    if options.cors_origins:
        virtual_host["typed_per_filter_config"] = {CORS: cors_policy(options.cors_origins)}
    config = {
        "@type": _API + "extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        "stat_prefix": "front",
        "codec_type": "AUTO",  # HTTP/1.1 for REST clients, HTTP/2 (h2c or ALPN) for gRPC
        # The edge: x-forwarded-for is the peer's address; a client's own x-request-id is kept
        # (the replicas take it as the request id) and made up where there is none.
        "use_remote_address": True,
        "preserve_external_request_id": True,
        "stream_idle_timeout": seconds(options.stream_idle_timeout_s),
        "route_config": {"name": "llmrpc", "virtual_hosts": [virtual_host]},
        "http_filters": [
            # CORS first: preflights are answered before the transcoder rejects OPTIONS.
            {
                "name": CORS,
                "typed_config": {"@type": _API + "extensions.filters.http.cors.v3.Cors"},
            },
            {"name": TRANSCODER, "typed_config": transcoder(options)},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _API + "extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": config}


def transcoder(options: EnvoyOptions) -> dict:
    """JSON over HTTP to gRPC, by the protos' ``google.api.http`` bindings."""
    config: dict = {
        "@type": _API + "extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
        "services": api_service_names(),
        # Errors become HTTP statuses (INVALID_ARGUMENT -> 400) with a google.rpc.Status body.
        "convert_grpc_status": True,
        # An unknown path gets 404 here rather than reaching a replica as a bogus gRPC call.
        "request_validation_options": {"reject_unknown_method": True},
        "print_options": {
            "preserve_proto_field_names": True,
            "always_print_primitive_fields": True,
            # GenerateStream (the only streaming method) as "data: {...}\n\n" events.
            "stream_sse_style_delimited": True,
        },
    }
    if options.descriptor_path is not None:
        config["proto_descriptor"] = options.descriptor_path
    else:
        config["proto_descriptor_bin"] = base64.b64encode(api_descriptor_set_bytes()).decode()
    return config


def routes(options: EnvoyOptions) -> list[dict]:
    # No route timeout (0s): a generation streams for as long as it takes; the client's
    # grpc-timeout, when sent, bounds the call instead (0s: no cap on it).
    grpc_route = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": GRPC_CLUSTER,
            "timeout": "0s",
            "max_stream_duration": {"grpc_timeout_header_max": "0s"},
            "retry_policy": GRPC_RETRY_POLICY,
        },
    }
    if not options.gateways:
        return [grpc_route]
    return [*openai_routes(), grpc_route]


def openai_routes() -> list[dict]:
    # The transcoder is off on these routes: OpenAI JSON must reach the gateway untouched, not
    # be rejected as an unknown method. (A per-route GrpcJsonTranscoder with no services would
    # do too, but Envoy requires a descriptor set in it: one more copy per route.)
    disabled = {"@type": _API + "config.route.v3.FilterConfig", "disabled": True}
    return [
        {
            "match": match,
            "route": {"cluster": GATEWAY_CLUSTER, "timeout": "0s"},
            "typed_per_filter_config": {TRANSCODER: disabled},
        }
        for match in gateway_matches()
    ]


def gateway_matches() -> list[dict]:
    """Envoy route matches for every path of the gateway's route table: a path with a parameter
    (``/v1/models/{model:path}``) as a prefix of whole segments (``/v1/models`` and what lies
    beneath it), the others exactly. None collides with a native REST path (/v1/generate,
    /v1/tokenize, /v1/admin/...), which the transcoder serves."""
    from llmrpc.gateway.app import route_paths  # FastAPI and the routes, only when asked

    paths = route_paths()
    prefixes = list(dict.fromkeys(p[: p.index("{")].rstrip("/") for p in paths if "{" in p))
    exact = [path for path in paths if "{" not in path and path not in prefixes]
    return [{"path": path} for path in exact] + [
        {"path_separated_prefix": prefix} for prefix in prefixes
    ]


def cors_policy(origins: tuple[str, ...]) -> dict:
    """``*`` allows any origin; others are matched exactly."""
    matchers = [{"safe_regex": {"regex": ".*"}} if o == "*" else {"exact": o} for o in origins]
    return {
        "@type": _API + "extensions.filters.http.cors.v3.CorsPolicy",
        "allow_origin_string_match": matchers,
        "allow_methods": "GET, POST, OPTIONS",
        "allow_headers": CORS_ALLOW_HEADERS,
        "expose_headers": CORS_EXPOSE_HEADERS,
        "max_age": "86400",
    }


def _cluster(name: str, endpoints: tuple[Endpoint, ...], options: EnvoyOptions) -> dict:
    lb_endpoints = [{"endpoint": {"address": e.to_envoy()}} for e in endpoints]
    thresholds = {
        "max_requests": options.max_requests,
        "max_pending_requests": options.max_requests,
    }
    static = all(e.is_ip for e in endpoints)
    cluster = {
        "name": name,
        # Names (a headless Service) resolve to every address they have; IPs need no DNS.
        "type": "STATIC" if static else "STRICT_DNS",
        "connect_timeout": "5s",
        "lb_policy": "LEAST_REQUEST",
        "common_lb_config": {"healthy_panic_threshold": {"value": options.panic_threshold_percent}},
        "circuit_breakers": {"thresholds": [thresholds]},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]},
    }
    if not static:
        cluster["dns_lookup_family"] = "V4_PREFERRED"  # "localhost" is 127.0.0.1 before ::1
    return cluster


def _health_check(check: HealthCheck, **kind: dict) -> dict:
    interval = seconds(check.interval_s)
    return {
        "timeout": seconds(check.timeout_s),
        "interval": interval,
        "no_traffic_interval": interval,  # else 60 s until the first request arrives
        "unhealthy_threshold": check.unhealthy_threshold,
        "healthy_threshold": check.healthy_threshold,
        **kind,
    }


def grpc_cluster(options: EnvoyOptions) -> dict:
    cluster = _cluster(GRPC_CLUSTER, options.backends, options)
    keepalive = seconds(options.upstream_keepalive_s)
    http2 = {"connection_keepalive": {"interval": keepalive, "timeout": "10s"}}
    cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _API + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": http2},
        }
    }
    check = options.health_check
    cluster["health_checks"] = [
        _health_check(check, grpc_health_check={"service_name": check.service_name})
    ]
    if options.upstream_tls is not None:
        cluster["transport_socket"] = upstream_tls_socket(options.upstream_tls)
    return cluster


def gateway_cluster(options: EnvoyOptions) -> dict:
    """The REST gateway replicas, over HTTP/1.1, health-checked with ``GET /health``."""
    cluster = _cluster(GATEWAY_CLUSTER, options.gateways, options)
    check = options.health_check
    cluster["health_checks"] = [
        _health_check(check, http_health_check={"path": check.gateway_path})
    ]
    return cluster
