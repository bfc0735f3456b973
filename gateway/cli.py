"""``llmrpc gateway --backend HOST:PORT [--backend ...]``: the OpenAI-compatible REST gateway alone,
in front of gRPC replicas (``llmrpc serve`` runs the same gateway in front of its own server).

The REST flags are ``vllm serve``'s, with its defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from llmrpc.common.args import OneLineErrorParser
from llmrpc.common.chat_template import read_chat_template
from llmrpc.common.fanout import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_SEQUENCES_PER_REQUEST
from llmrpc.common.fd_limit import raise_open_file_limit
from llmrpc.gateway.settings import (
    CONTENT_FORMATS,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BODY_SIZE,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
    DEFAULT_RESPONSES_STORE_MAX_BYTES,
    UVICORN_LOG_LEVELS,
    ApiSettings,
    BackendSettings,
    CorsSettings,
    GatewaySettings,
    HttpSettings,
)

logger = logging.getLogger("llmrpc.gateway")


def _json_list(text: str) -> list:
    value = json.loads(text)
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {text!r}")
    return value


def _add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gRPC replicas")
    add = group.add_argument
    add(
        "--backend",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="A gRPC replica (llmrpc serve --grpc-port); repeat for each. Requests go to the "
        "serving replica with the fewest in flight; NOT_SERVING ones get none.",
    )
    add("--backend-api-key", help="API key the replicas require. Default: the first --api-key.")
    add("--backend-tls", action="store_true", help="Connect to the replicas over TLS.")
    add("--backend-ca-certs", help="CA certificates (PEM) of the replicas (turns TLS on).")
    add("--backend-certfile", help="Client certificate (PEM) for replicas requiring mTLS.")
    add("--backend-keyfile", help="Private key (PEM) of --backend-certfile.")
    add("--backend-server-name", help="Name expected in the replicas' certificates.")


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("REST listener")
    add = group.add_argument
    add("--host", help="Address to listen on. Default: all addresses.")
    add("--port", type=int, default=8000, help="Default: %(default)s.")
    add("--uds", help="Listen on this Unix socket instead (host and port ignored).")
    add("--root-path", help="Path prefix when behind a path-routing proxy.")
    add("--ssl-keyfile", help="Private key (PEM) of --ssl-certfile.")
    add("--ssl-certfile", help="Certificate chain (PEM): HTTPS.")
    add("--ssl-ca-certs", help="CA certificates (PEM) that client certificates must chain to.")
    add(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="Client certificates: 0 not asked for, 1 optional, 2 required (mutual TLS).",
    )
    add(
        "--enable-ssl-refresh",
        action="store_true",
        help="Serve replaced certificate files to new connections without a restart.",
    )
    add(
        "--h11-max-incomplete-event-size",
        type=int,
        default=4194304,
        help="Largest request head in bytes. Default: %(default)s.",
    )
    add(
        "--h11-max-header-count",
        type=int,
        default=256,
        help="Most header fields in a request. Default: %(default)s.",
    )
    add(
        "--max-request-body-size",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_SIZE,
        metavar="BYTES",
        help="Largest request body; larger ones get HTTP 413. Default: %(default)s (the gRPC "
        "servers' default --grpc-max-receive-message-size).",
    )
    add(
        "--request-body-timeout",
        type=float,
        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
        dest="request_body_timeout_s",
        metavar="SECONDS",
        help="A request body must arrive within this long, else HTTP 408 (slow clients cannot "
        "hold connections). Default: %(default)s.",
    )
    add(
        "--request-header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        dest="header_timeout_s",
        metavar="SECONDS",
        help="A new connection's TLS handshake, then each request head, must arrive within "
        "this long (an unfinished head gets HTTP 408), else the connection closes. Default: "
        "%(default)s.",
    )
    add(
        "--rest-keep-alive-timeout",
        type=float,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        dest="keep_alive_timeout_s",
        metavar="SECONDS",
        help="A connection idle this long after a response is closed. Default: %(default)s.",
    )
    add(
        "--rest-max-connections",
        type=int,
        dest="max_connections",
        metavar="N",
        help="Most connections held at once; more are closed as they are accepted. Default: a "
        "quarter of the process's open-file limit (raised to its hard limit at start-up).",
    )
    add("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    add("--disable-uvicorn-access-log", action="store_true")
    add("--allowed-origins", type=_json_list, default=["*"], help="CORS: a JSON list.")
    add("--allowed-methods", type=_json_list, default=["*"], help="CORS: a JSON list.")
    add("--allowed-headers", type=_json_list, default=["*"], help="CORS: a JSON list.")
    add("--allow-credentials", action="store_true", help="CORS: allow credentials.")


# On/off flags of the OpenAI API: (flag, help).
_API_SWITCHES = (
    ("--return-tokens-as-token-ids", "Logprob tokens written as token_id:N."),
    ("--enable-prompt-tokens-details", "usage.prompt_tokens_details.cached_tokens in responses."),
    ("--enable-force-include-usage", "Streams end with a usage chunk even when not asked for."),
    ("--enable-tokenizer-info-endpoint", "GET /get_tokenizer_info (may reveal the chat template)."),
    ("--enable-server-load-tracking", "GET /load: generation requests in flight here."),
    ("--enable-request-id-headers", "X-Request-Id on responses."),
    ("--disable-fastapi-docs", "No OpenAPI schema, Swagger UI or ReDoc."),
)


def _add_api_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI API")
    add = group.add_argument
    add(
        "--api-key",
        nargs="+",
        default=[],
        help="Bearer key(s) REST callers must send (health, version and metrics exempt).",
    )
    add(
        "--chat-template",
        help="Chat template to render chat requests with, instead of the replicas' model's: a "
        "file's path, or (if no such file, and the value holds a brace or a line break) the "
        "template itself.",
    )
    add("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS)
    add("--response-role", default="assistant", help="Role of chat answers.")
    for flag, help_text in _API_SWITCHES:
        add(flag, action="store_true", help=help_text)
    add(
        "--middleware",
        action="append",
        default=[],
        metavar="IMPORT.PATH",
        help="ASGI middleware class or async HTTP middleware function; repeatable.",
    )
    add(
        "--responses-store-max-bytes",
        type=int,
        default=DEFAULT_RESPONSES_STORE_MAX_BYTES,
        metavar="BYTES",
        help="Bytes the Responses API's store may hold (0: nothing is kept); past them the least "
        "recently used responses go first. Default: %(default)s (256 MiB).",
    )
    add(
        "--max-prompts-per-request",
        type=int,
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help="Most prompts in one request (completions' prompt list, embeddings' input); more "
        "are a 400 naming it. Default: %(default)s (OpenAI's bound on embeddings inputs).",
    )
    add(
        "--max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="Most sequences in one request (prompts x n); more are a 400 naming prompt or n. "
        "Default: %(default)s.",
    )
    add(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="OpenTelemetry collector URL (http://, or https:// for TLS): a span per REST "
        "request, a child of its W3C traceparent header, carrying gen_ai.request.id; the gRPC "
        "calls made for it carry its trace on. OTLP over gRPC, or over HTTP with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (the full .../v1/traces URL).",
    )
    add("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="llmrpc gateway", description=__doc__.split("\n\n")[0])
    _add_backend_arguments(parser)
    _add_http_arguments(parser)
    _add_api_arguments(parser)
    return parser


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """Raises ValueError naming the flag."""
    v = vars(args)
    http_fields = {name: v[name] for name in HttpSettings.__dataclass_fields__}
    api_key = args.backend_api_key or (args.api_key[0] if args.api_key else None)
    backends = BackendSettings(
        targets=tuple(args.backend),
        api_key=api_key,
        tls=args.backend_tls,
        ca_certs=args.backend_ca_certs,
        client_cert=args.backend_certfile,
        client_key=args.backend_keyfile,
        server_name=args.backend_server_name,
    )
    cors = CorsSettings(
        tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
        args.allow_credentials,
    )  # fmt: skip
    api_fields = {name: v[name] for name in ApiSettings.__dataclass_fields__ if name in v}
    api_fields.update(
        api_keys=tuple(args.api_key),
        chat_template=None
        if args.chat_template is None
        else read_chat_template(args.chat_template),
        middleware=tuple(args.middleware),
    )
    return GatewaySettings(backends, HttpSettings(**http_fields), cors, ApiSettings(**api_fields))


async def run(settings: GatewaySettings) -> int:
    """Serve until SIGTERM or SIGINT (exit status 0)."""
    from llmrpc.gateway.app import create_app
    from llmrpc.gateway.server import GatewayServer

    server = GatewayServer(create_app(settings), settings.http)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait((stopping, server.stopped), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    logger.info("stopping the REST gateway")
    await server.stop()
    return 0


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from_args(args)
        raise_open_file_limit()  # before the listener's connection cap is derived from it
        return asyncio.run(run(settings))
    except ValueError as error:
        parser.error(str(error))
    except RuntimeError as error:  # the listener could not be bound
        logger.error("%s", error)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
