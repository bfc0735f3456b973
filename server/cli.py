"""The ``llmrpc`` command line: ``llmrpc serve [MODEL] [flags]`` (vLLM's flags; see --help).

Other verbs live with the layer they belong to and are imported only when used, so a client verb
never loads torch: each is a ``main(argv)`` that receives the arguments after the verb.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys

from llmrpc.server import options

logger = logging.getLogger("llmrpc.server.cli")

# verb -> (module whose main(argv) runs it, one-line help)
DELEGATED_VERBS: dict[str, tuple[str, str]] = {}

_LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
_LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format=_LOG_FORMAT, datefmt=_LOG_DATE_FORMAT, force=True
    )


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and its ``serve`` subparser."""
    from llmrpc.server.servicers import server_version

    parser = options.OneLineErrorParser(
        prog="llmrpc", description="LLM inference server with a gRPC-first API."
    )
    parser.add_argument("--version", action="version", version=f"llmrpc {server_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="Serve a model over gRPC.",
        description="Serve a model over gRPC (health and reflection always on). Flags take "
        "vLLM's names and defaults.",
    )
    options.add_serve_arguments(serve)
    for verb, (_, summary) in DELEGATED_VERBS.items():
        commands.add_parser(verb, help=summary, add_help=False)
    return parser, serve


def run_serve(serve_parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    engine_config, frontend = options.configs_or_exit(serve_parser, args)
    configure_logging(args.log_level)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: never wait on the network
    options.warn_about_inert_options(frontend, logger)
    from llmrpc.server import app  # torch and the engine: imported only when serving

    try:
        return asyncio.run(app.serve(engine_config, frontend))
    except app.BindError as error:
        logger.error("%s", error)
        return 1
    except ValueError as error:  # a flag value the engine found wrong while loading
        logger.error("%s", error)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED_VERBS:
        module = importlib.import_module(DELEGATED_VERBS[argv[0]][0])
        return module.main(argv[1:])
    parser, serve_parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_serve(serve_parser, args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
