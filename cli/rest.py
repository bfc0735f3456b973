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

import dataclasses

from llmrpc.common.chat_template import read_chat_template
from llmrpc.gateway.app import create_app
from llmrpc.gateway.server import GatewayServer
from llmrpc.gateway.settings import BackendSettings, GatewaySettings
from llmrpc.server.settings import FrontendConfig

IN_PROCESS_TARGET = "in-process"  # the gateway's name for its server (logs, /metrics)


def gateway_settings(frontend: FrontendConfig) -> GatewaySettings:
    """The gateway's settings: those the REST flags filled (``frontend.rest_http``,
    ``rest_cors``, ``rest_api``), completed with what the server shares between gRPC and REST:
    host, TLS, keys, chat template, tracing and limits. ValueError names a bad flag."""
    tls = frontend.tls
    backends = BackendSettings(
        targets=(IN_PROCESS_TARGET,),
        api_key=frontend.api_key[0] if frontend.api_key else None,
        forward_api_key=True,
    )
    http = dataclasses.replace(
        frontend.rest_http, host=frontend.host,
        ssl_keyfile=tls.keyfile, ssl_certfile=tls.certfile, ssl_ca_certs=tls.ca_certs,
        ssl_cert_reqs=tls.cert_reqs, enable_ssl_refresh=tls.refresh,
        max_request_body_size=_body_limit(frontend),
    )  # fmt: skip
    # The template the server's tokenizer has too: shown by /get_tokenizer_info.
    template = frontend.chat_template
    api = dataclasses.replace(
        frontend.rest_api,
        api_keys=_rest_keys(frontend),
        chat_template=None if template is None else read_chat_template(template),
        otlp_traces_endpoint=frontend.tracing.otlp_traces_endpoint,
        max_prompts_per_request=frontend.limits.max_prompts_per_request,
        max_sequences_per_request=frontend.limits.max_sequences_per_request,
    )
    return GatewaySettings(backends, http, frontend.rest_cors, api)


def _body_limit(frontend: FrontendConfig) -> int:
    """--max-request-body-size, by default the gRPC receive limit: a larger body could not be
    passed on anyway."""
    limit = frontend.rest_http.max_request_body_size
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
