"""The OpenAI-compatible REST gateway ``llmrpc serve`` runs beside its gRPC server.

It runs in the server's process, on its event loop, and reaches the gRPC services through the
server's in-process channel: the same interceptors and servicers as a network call, with no
serialization or HTTP/2 per streamed token, so REST streams cost the server about what gRPC
streams do. One process keeps one lifecycle (signals, drain, exit status). The API key
interceptor still applies: the gateway sends each REST caller's own key, so the server
authorizes the caller (its rights, its requests to Abort), not the gateway. REST takes the same
keys, host, TLS files and client-certificate rule as gRPC.
"""

from __future__ import annotations

from llmrpc.common.chat_template import read_chat_template
from llmrpc.gateway.app import create_app
from llmrpc.gateway.server import GatewayServer
from llmrpc.gateway.settings import (
    ApiSettings,
    BackendSettings,
    CorsSettings,
    GatewaySettings,
    HttpSettings,
)
from llmrpc.server.settings import FrontendConfig

IN_PROCESS_TARGET = "in-process"  # the gateway's name for its server (logs, /metrics)


def gateway_settings(frontend: FrontendConfig) -> GatewaySettings:
    """The gateway's settings from the serve flags; ValueError names a bad flag."""
    rest, tls = frontend.rest, frontend.tls
    backends = BackendSettings(
        targets=(IN_PROCESS_TARGET,),
        api_key=frontend.api_key[0] if frontend.api_key else None,
        forward_api_key=True,
    )
    http = HttpSettings(
        host=frontend.host, port=rest.port, uds=rest.uds, root_path=rest.root_path,
        ssl_keyfile=tls.keyfile, ssl_certfile=tls.certfile, ssl_ca_certs=tls.ca_certs,
        ssl_cert_reqs=tls.cert_reqs, enable_ssl_refresh=tls.refresh,
        h11_max_incomplete_event_size=rest.h11_max_incomplete_event_size,
        h11_max_header_count=rest.h11_max_header_count,
        uvicorn_log_level=rest.uvicorn_log_level,
        disable_uvicorn_access_log=rest.disable_uvicorn_access_log,
        max_request_body_size=_body_limit(frontend),
        request_body_timeout_s=rest.request_body_timeout_s,
        max_connections=rest.max_connections,
        header_timeout_s=rest.header_timeout_s,
        keep_alive_timeout_s=rest.keep_alive_timeout_s,
    )  # fmt: skip
    cors = CorsSettings(
        rest.allowed_origins, rest.allowed_methods, rest.allowed_headers, rest.allow_credentials
    )
    names = [name for name in ApiSettings.__dataclass_fields__ if hasattr(rest, name)]
    api_fields = {name: getattr(rest, name) for name in names}
    # The template the server's tokenizer has too: shown by /get_tokenizer_info.
    template = frontend.chat_template
    api_fields["chat_template"] = None if template is None else read_chat_template(template)
    api_fields["otlp_traces_endpoint"] = frontend.tracing.otlp_traces_endpoint
    api_fields["max_prompts_per_request"] = frontend.limits.max_prompts_per_request
    api_fields["max_sequences_per_request"] = frontend.limits.max_sequences_per_request
    api = ApiSettings(api_keys=_rest_keys(frontend), **api_fields)
    return GatewaySettings(backends, http, cors, api)


def _body_limit(frontend: FrontendConfig) -> int:
    """--max-request-body-size, by default the gRPC receive limit: a larger body could not be
    passed on anyway."""
    limit = frontend.rest.max_request_body_size
    return frontend.limits.max_receive_message_size if limit is None else limit


def _rest_keys(frontend: FrontendConfig) -> tuple[str, ...]:
    """The keys REST takes: --api-key's and the admin keys (which generate too); none, REST
    open, when generation needs no key."""
    return (*frontend.api_key, *frontend.admin_api_key) if frontend.api_key else ()


def in_process_gateway(frontend: FrontendConfig, channel) -> GatewayServer:
    """The gateway calling the server through ``channel``, not yet bound or started; ValueError
    names a bad flag (``--middleware``, TLS files)."""
    settings = gateway_settings(frontend)
    return GatewayServer(create_app(settings, {IN_PROCESS_TARGET: channel}), settings.http)
