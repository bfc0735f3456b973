"""``llmrpc bench serve|throughput``: argument parsing and exit codes; the work is in ``serve``
and ``throughput`` (the latter imports torch and the engine only when it runs)."""

from __future__ import annotations

from llmrpc.clients.bench import serve, throughput
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
    throughput.add_arguments(
        commands.add_parser(
            "throughput",
            help="Offline throughput of the engine in this process, optionally vs Transformers.",
            description=throughput.__doc__,
        )
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    module = serve if args.mode == "serve" else throughput
    return common.run_command(lambda: module.main(args))
