"""``llmrpc bench serve``: argument parsing and exit codes (the work is in ``serve``).

``llmrpc bench throughput`` runs the engine in this process, so it lives with the engine
(``llmrpc.engine.bench``) and the ``llmrpc`` command hands it there; it is listed here only so
that ``llmrpc bench --help`` shows both modes.
"""

from __future__ import annotations

from llmrpc.clients.bench import serve
from llmrpc.clients.cli import common

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
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mode != "serve":
        parser.error(f"bench {args.mode} is run by the llmrpc command: llmrpc bench {args.mode}")
    return common.run_command(lambda: serve.main(args))
