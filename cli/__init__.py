"""The ``llmrpc`` command: ``llmrpc serve [MODEL] [flags]`` (vLLM's flags; see --help) and the
other verbs.

This package sits above the others: it composes the gRPC server (``llmrpc.server``) and the REST
gateway (``llmrpc.gateway``) for ``serve``, and hands every other verb to the layer it belongs
to. Those are imported only when used, so a client verb never loads torch: each is a
``main(argv)`` that receives the arguments after the verb.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from llmrpc.common.args import OneLineErrorParser
from llmrpc.server import options

# verb -> (module whose main(argv) runs it, one-line help)
DELEGATED_VERBS: dict[str, tuple[str, str]] = {
    "generate": ("llmrpc.clients.cli.generate", "Generate text from a prompt on a running server."),
    "chat": ("llmrpc.clients.cli.chat", "Chat with a running server (streamed, history kept)."),
    "tokenize": ("llmrpc.clients.cli.tokenize", "Tokenize text with a running server's tokenizer."),
    "embed": ("llmrpc.clients.cli.embed", "Embed texts with a running server's model."),
    "admin": ("llmrpc.clients.cli.admin", "Server info, models, health and request control."),
    "bench": ("llmrpc.clients.bench.cli", "Benchmark a server (serve) or the engine (throughput)."),
    "gateway": ("llmrpc.gateway.cli", "Serve the OpenAI-compatible REST API for gRPC replicas."),
    "envoy-config": ("llmrpc.gateway.envoy_cli", "Print an Envoy bootstrap (YAML) for replicas."),
    "k8s-manifests": ("llmrpc.gateway.k8s_cli", "Print Kubernetes manifests (YAML) for serving."),
}

# (verb, mode) -> module whose main(argv) runs it, given the arguments after the mode: modes of a
# client verb that belong to a lower layer (the engine benchmark runs the engine in-process).
DELEGATED_MODES: dict[tuple[str, str], str] = {("bench", "throughput"): "llmrpc.engine.bench"}


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and its ``serve`` subparser."""
    parser = OneLineErrorParser(
        prog="llmrpc", description="LLM inference server with a gRPC-first API."
    )
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        add_help=False,  # the serve flags bring their own --help (--help=all, --help=GROUP)
        help="Serve a model over gRPC and the OpenAI-compatible REST API.",
        description="Serve a model over gRPC (health and reflection always on) and, unless "
        "--no-rest-gateway, the OpenAI-compatible REST API.",
    )
    options.add_serve_arguments(serve)
    for verb, (_, summary) in DELEGATED_VERBS.items():
        commands.add_parser(verb, help=summary, add_help=False)
    return parser, serve


class _VersionAction(argparse.Action):
    """``--version``, read only when asked: ``server.state``, which says it, imports gRPC and
    the generated stubs, which ``--help`` and a bad flag need not wait for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        kwargs.setdefault("help", "show the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from llmrpc.server.state import server_version

        print(f"llmrpc {server_version()}")
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if tuple(argv[:2]) in DELEGATED_MODES:
        return importlib.import_module(DELEGATED_MODES[tuple(argv[:2])]).main(argv[2:])
    if argv and argv[0] in DELEGATED_VERBS:
        module = importlib.import_module(DELEGATED_VERBS[argv[0]][0])
        return module.main(argv[1:])
    parser, serve_parser = build_parser()
    if argv and argv[0] == "serve":
        from llmrpc.cli.serve import run_serve

        return run_serve(serve_parser, argv[1:])
    parser.parse_args(argv)  # --help, --version, or an unknown verb (exits)
    parser.print_help(sys.stderr)
    return 2
