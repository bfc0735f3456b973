"""What the client verbs share: connection flags (with environment defaults), sampling flags,
exit codes, and turning a failed call into one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict

import grpc

from llmrpc.clients.base import DEFAULT_TARGET
from llmrpc.clients.client import Client
from llmrpc.clients.errors import LlmrpcError
from llmrpc.common.args import OneLineErrorParser

# Exit codes, documented in every verb's --help (EXIT_CODES_HELP).
EXIT_OK = 0
EXIT_SERVER_ERROR = 1  # the server failed (INTERNAL, UNKNOWN...) or answered unexpectedly
EXIT_USAGE = 2  # bad command-line flags (argparse's own code)
EXIT_UNAVAILABLE = 3  # no server reachable, still loading, or overloaded: try again later
EXIT_REJECTED = 4  # the server refused the request as asked (INVALID_ARGUMENT, NOT_FOUND...)
EXIT_AUTH = 5  # missing or wrong API key or client certificate
EXIT_TIMEOUT = 6  # the --timeout passed
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT

EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    the server failed (INTERNAL and other unexpected statuses)
  2    bad command-line usage
  3    server unreachable, still loading or overloaded (UNAVAILABLE, RESOURCE_EXHAUSTED)
  4    request rejected (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION,
       OUT_OF_RANGE)
  5    not authorized (UNAUTHENTICATED, PERMISSION_DENIED)
  6    timed out (DEADLINE_EXCEEDED)
  130  interrupted
"""

_EXIT_BY_CODE = {
    grpc.StatusCode.UNAVAILABLE: EXIT_UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EXIT_UNAVAILABLE,
    grpc.StatusCode.INVALID_ARGUMENT: EXIT_REJECTED,
    grpc.StatusCode.NOT_FOUND: EXIT_REJECTED,
    grpc.StatusCode.ALREADY_EXISTS: EXIT_REJECTED,
    grpc.StatusCode.FAILED_PRECONDITION: EXIT_REJECTED,
    grpc.StatusCode.OUT_OF_RANGE: EXIT_REJECTED,
    grpc.StatusCode.UNAUTHENTICATED: EXIT_AUTH,
    grpc.StatusCode.PERMISSION_DENIED: EXIT_AUTH,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_TIMEOUT,
}

# Flag -> environment variable that gives its default.
ENVIRONMENT = {
    "target": "LLMRPC_TARGET",
    "api_key": "LLMRPC_API_KEY",
    "ca_cert": "LLMRPC_CA_CERT",
    "client_cert": "LLMRPC_CLIENT_CERT",
    "client_key": "LLMRPC_CLIENT_KEY",
}


class CommandError(Exception):
    """A verb cannot do what was asked; its message goes to stderr and it exits ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_SERVER_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Parser(OneLineErrorParser):
    """One-line usage errors naming the closest flag (exit 2), and the exit codes at the end of
    --help."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("epilog", EXIT_CODES_HELP)
        super().__init__(**kwargs)


def add_connection_arguments(
    parser: argparse.ArgumentParser, default_target: str | None = DEFAULT_TARGET
) -> None:
    group = parser.add_argument_group("connection (defaults from LLMRPC_* environment variables)")
    env = {name: os.environ.get(var) for name, var in ENVIRONMENT.items()}
    group.add_argument(
        "--target",
        "--url",
        default=env["target"] or default_target,
        help="Server address: host:port, unix:/path, grpc://host:port or grpcs://host:port "
        f"(TLS) (env LLMRPC_TARGET; default {default_target or 'per backend'}).",
    )
    group.add_argument("--tls", action="store_true", help="Use TLS, verified by system roots.")
    group.add_argument(
        "--ca-cert", default=env["ca_cert"], help="CA certificate (PEM) to verify the server."
    )
    group.add_argument("--client-cert", default=env["client_cert"], help="mTLS certificate.")
    group.add_argument("--client-key", default=env["client_key"], help="mTLS private key.")
    group.add_argument("--server-name", help="Name to expect in the server's certificate.")
    group.add_argument(
        "--api-key",
        default=env["api_key"],
        help="Bearer API key (env LLMRPC_API_KEY; prefer it: flags show in process lists).",
    )
    group.add_argument("--timeout", type=float, help="Deadline of each call in seconds.")


def client_from_args(args: argparse.Namespace, model: str = "", client_class=Client):
    """A ``Client`` (or ``client_class``, e.g. ``AsyncClient``) from the connection flags."""
    return client_class(
        args.target,
        model=model,
        tls=args.tls,
        ca_cert=args.ca_cert,
        client_cert=args.client_cert,
        client_key=args.client_key,
        server_name=args.server_name,
        api_key=args.api_key,
        timeout=args.timeout,
    )


def run_command(command: Callable[[], int | None]) -> int:
    """Run a verb: a failed call becomes one line on stderr and its exit code."""
    try:
        return command() or EXIT_OK
    except LlmrpcError as error:
        where = f" (request id {error.request_id})" if error.request_id else ""
        print(f"llmrpc: error: {error.code_name}: {error.message}{where}", file=sys.stderr)
        return _EXIT_BY_CODE.get(error.code, EXIT_SERVER_ERROR)
    except CommandError as error:
        print(f"llmrpc: error: {error}", file=sys.stderr)
        return error.exit_code
    except (FileNotFoundError, PermissionError, IsADirectoryError, ValueError) as error:
        # Missing or unreadable files given by flags (certificates, datasets), bad values.
        print(f"llmrpc: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


def print_json(value, indent: int | None = None) -> None:
    """Print a dataclass (or a list of them, or plain data) as JSON, on one line by default."""
    print(json.dumps(_plain(value), indent=indent), flush=True)


def _plain(value):
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value


SAMPLING_HELP = """\
Sampling flags left unset take the server's defaults, which `llmrpc admin info`
shows as default_sampling: an llmrpc server reads them from the model's
generation_config.json and its --override-generation-config, else uses
temperature 1.0 and top-p 1.0. Set them per call, e.g. --temperature 0.2
--top-p 0.9 for steadier answers or --temperature 0 for greedy ones, and the
length with --max-tokens N."""


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens_help: str) -> None:
    """Flags for ``GenerateParams``; unset sampling flags leave the server's defaults in force,
    and an unset --max-tokens is the verb's own default (``max_tokens_help`` says which)."""
    group = parser.add_argument_group("sampling and stopping", SAMPLING_HELP)
    group.add_argument("--model", default="", help="Served model name (default: the server's).")
    group.add_argument("--max-tokens", type=int, help=max_tokens_help)
    group.add_argument("--temperature", type=float, help="0 is greedy.")
    group.add_argument("--top-p", type=float)
    group.add_argument("--top-k", type=int)
    group.add_argument("--min-p", type=float)
    group.add_argument("--seed", type=int, help="Same seed, same tokens.")
    group.add_argument("--min-tokens", type=int)
    group.add_argument(
        "--stop", action="append", help="Stop at this string (repeat for more than one)."
    )
    group.add_argument("--stop-token-id", type=int, action="append", dest="stop_token_ids")
    group.add_argument("--ignore-eos", action="store_true", default=None)
    group.add_argument("--time-limit", type=float, help="Seconds before the output is cut.")
    group.add_argument("--repetition-penalty", type=float)
    group.add_argument("--presence-penalty", type=float)
    group.add_argument("--frequency-penalty", type=float)


_SAMPLING_FLAGS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop",
    "stop_token_ids", "ignore_eos", "time_limit", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "n", "logprobs",
)  # fmt: skip


def sampling_params(args: argparse.Namespace) -> dict:
    """The ``GenerateParams`` keyword arguments of the flags given (``--n`` and ``--logprobs``
    belong to ``generate`` alone)."""
    values = {name: getattr(args, name, None) for name in _SAMPLING_FLAGS}
    return {name: value for name, value in values.items() if value is not None}


def max_tokens_within_context(
    num_prompt_tokens: int, max_model_len: int, limit: int | None = None
) -> int | None:
    """The default length of an output: ``limit`` tokens (None: as many as fit), cut to the
    room the context window leaves after the prompt. None, to leave the length to the server,
    when the prompt leaves no room (the server then says the prompt is too long)."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        return None
    return room if limit is None else min(limit, room)
