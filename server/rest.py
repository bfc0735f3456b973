"""The OpenAI-compatible REST gateway ``llmrpc serve`` runs beside its gRPC server.

It runs in the server's process, on its event loop: the gateway is a few percent of a core at
32 streams (JSON and HTTP framing), measured at the same throughput as gRPC, and one process
keeps one lifecycle (signals, drain, exit status) with no second interpreter to supervise.

It reaches the gRPC server through a private plaintext Unix socket in a directory only this
user can enter, so it needs no client certificate when the gRPC port requires mutual TLS; the
API key interceptor still applies there, and the gateway sends the first ``--api-key``. REST
takes the same keys, host, TLS files and client-certificate rule as gRPC.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import grpc

from llmrpc.server.settings import BindError, FrontendConfig

logger = logging.getLogger(__name__)


class PrivatePort:
    """A plaintext gRPC port on a Unix socket in a fresh mode-0700 directory."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="llmrpc-"))  # created with mode 0700
        self.target = f"unix:{self.directory / 'grpc.sock'}"
        server.add_insecure_port(self.target)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def gateway_settings(frontend: FrontendConfig, grpc_target: str):
    """The gateway's settings from the serve flags; ValueError names a bad flag."""
    from llmrpc.gateway.cli import read_chat_template
    from llmrpc.gateway.settings import (
        ApiSettings,
        BackendSettings,
        CorsSettings,
        GatewaySettings,
        HttpSettings,
    )

    rest, tls = frontend.rest, frontend.tls
    backends = BackendSettings(
        targets=(grpc_target,), api_key=frontend.api_key[0] if frontend.api_key else None
    )
    http = HttpSettings(
        host=frontend.host, port=rest.port, uds=rest.uds, root_path=rest.root_path,
        ssl_keyfile=tls.keyfile, ssl_certfile=tls.certfile, ssl_ca_certs=tls.ca_certs,
        ssl_cert_reqs=tls.cert_reqs, enable_ssl_refresh=tls.refresh,
        h11_max_incomplete_event_size=rest.h11_max_incomplete_event_size,
        h11_max_header_count=rest.h11_max_header_count,
        uvicorn_log_level=rest.uvicorn_log_level,
        disable_uvicorn_access_log=rest.disable_uvicorn_access_log,
    )  # fmt: skip
    cors = CorsSettings(
        rest.allowed_origins, rest.allowed_methods, rest.allowed_headers, rest.allow_credentials
    )
    names = [name for name in ApiSettings.__dataclass_fields__ if hasattr(rest, name)]
    api_fields = {name: getattr(rest, name) for name in names}
    # The template the server's tokenizer has too: shown by /get_tokenizer_info.
    api_fields["chat_template"] = read_chat_template(frontend.chat_template)
    api = ApiSettings(api_keys=frontend.api_key, **api_fields)
    return GatewaySettings(backends, http, cors, api)


async def start_gateway(frontend: FrontendConfig, grpc_target: str):
    """A started ``GatewayServer``; BindError if its socket cannot be bound."""
    from llmrpc.gateway.app import create_app
    from llmrpc.gateway.server import BindError as GatewayBindError
    from llmrpc.gateway.server import GatewayServer

    settings = gateway_settings(frontend, grpc_target)
    try:
        server = GatewayServer(create_app(settings), settings.http)
    except GatewayBindError as error:
        raise BindError(str(error)) from None
    await server.start()
    return server
