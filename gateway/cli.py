"""``llmrpc gateway --backend HOST:PORT [--backend ...]``: the OpenAI-compatible REST gateway alone,
in front of gRPC replicas (``llmrpc serve`` runs the same gateway in front of its own server).

The REST flags are ``vllm serve``'s, with its defaults. Those of the listener, CORS and the API
are declared once, on the settings fields they fill (``common.rest_settings``), and read from
there by this parser and ``llmrpc serve``'s alike: the same names, defaults and help ("(llmrpc)"
marks our own flags, not vLLM's).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from llmrpc.common.args import OneLineErrorParser
from llmrpc.common.chat_template import read_chat_template
from llmrpc.common.fanout import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_SEQUENCES_PER_REQUEST
from llmrpc.common.fd_limit import raise_open_file_limit
from llmrpc.common.rest_options import RestOption, declared_options, shown_help
from llmrpc.gateway.settings import (
    ApiSettings,
    BackendSettings,
    CorsSettings,
    GatewaySettings,
    HttpSettings,
)

logger = logging.getLogger("llmrpc.gateway")


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


def _add_declared(group: argparse._ArgumentGroup, settings_class: type) -> None:
    """The REST flags declared on ``settings_class``'s fields (``common.rest_settings``):
    ``llmrpc serve`` takes the same ones, with the same defaults and help."""
    for declared in declared_options(settings_class):
        group.add_argument(declared.name, **_argument_options(declared))


def _argument_options(declared: RestOption) -> dict:
    options = {
        "dest": declared.field,
        "default": declared.default,
        "help": shown_help(declared.help, declared.default, declared.ours),
    }
    if declared.parse is None:
        options["action"] = "store_true"
        return options
    options["type"] = declared.parse
    if declared.repeatable:
        options["action"] = "extend"
    for key in ("choices", "nargs", "metavar"):
        if getattr(declared, key) is not None:
            options[key] = getattr(declared, key)
    return options


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("REST listener")
    add = group.add_argument
    add("--host", help="Address to listen on. Default: all addresses.")
    _add_declared(group, HttpSettings)
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
    _add_declared(group, CorsSettings)


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
    _add_declared(group, ApiSettings)
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
    http = HttpSettings(
        host=args.host, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        enable_ssl_refresh=args.enable_ssl_refresh, **_declared_values(args, HttpSettings),
    )  # fmt: skip
    api = ApiSettings(
        api_keys=tuple(args.api_key),
        chat_template=None
        if args.chat_template is None
        else read_chat_template(args.chat_template),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        max_prompts_per_request=args.max_prompts_per_request,
        max_sequences_per_request=args.max_sequences_per_request,
        **_declared_values(args, ApiSettings),
    )
    cors = CorsSettings(**_declared_values(args, CorsSettings))
    return GatewaySettings(backends, http, cors, api)


def _declared_values(args: argparse.Namespace, settings_class: type) -> dict:
    """The values of the flags declared on ``settings_class``, by field (lists as tuples)."""
    values = {
        declared.field: getattr(args, declared.field)
        for declared in declared_options(settings_class)
    }
    return {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}


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
