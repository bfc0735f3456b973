"""``llmrpc bench serve|throughput``: argument parsing and exit codes of ``bench serve`` (the work
is in ``serve``), and the hand-off of ``bench throughput`` to the engine's own benchmark.

``throughput`` runs the engine in this process, so it lives with the engine
(``llmrpc.engine.bench``). The clients never import the engine: this module names it and imports
it by name only when that mode is asked for, as ``llmrpc``'s top-level command line does with its
verbs.
"""

from __future__ import annotations

import importlib

from llmrpc.clients.bench import serve
from llmrpc.clients.cli import common

# mode -> module whose main(argv) runs it, given the arguments after the mode
DELEGATED_MODES = {"throughput": "llmrpc.engine.bench"}

SERVE_EPILOG = (
    "bench serve exits 1 when any request failed (the table and JSON count them).\n\n"
    + common.EXIT_CODES_HELP
)


def build_parser() -> common.Parser:
    parser = common.Parser(
        prog="llmrpc bench",
        description="Benchmark a running server (serve) or the engine in-process (throughput).",
    )
    commands = parser.add_subparsers(dest="mode", metavar="MODE", required=True)
    serve.add_arguments(
        commands.add_parser(
            "serve",
            help="Load a running server with streamed requests; TTFT, TPOT, ITL, throughput.",
            description="Stream requests to our gRPC server or any OpenAI-compatible server "
            "at a set concurrency and arrival rate; print a table, optionally JSON and a plot.",
            epilog=SERVE_EPILOG,
        )
    )
    commands.add_parser(
        "throughput",
        help="Offline throughput of the engine in this process, optionally vs Transformers "
        "(see llmrpc bench throughput --help).",
        add_help=False,
    )
    return parser


def main(argv: list[str]) -> int:
    if argv and argv[0] in DELEGATED_MODES:
        return importlib.import_module(DELEGATED_MODES[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    return common.run_command(lambda: serve.main(args))
