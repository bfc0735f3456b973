"""The ``llmrpc serve`` option surface: vLLM's flag names, defaults and value syntax.

``add_serve_arguments`` declares the flags; ``build_configs`` turns the parsed namespace into the
typed engine configuration and the frontend settings. Bad values end the program with one line
naming the flag (exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import re
from decimal import Decimal, InvalidOperation
from typing import NoReturn

from llmrpc.engine.config import (
    DTYPES,
    LOAD_FORMATS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from llmrpc.server.settings import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, FrontendConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kmgtKMGT]?)$")
_EXPONENTS = {"k": 1, "m": 2, "g": 3, "t": 4}


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad value in one line (no usage dump) and exits with status 2, like argparse."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def human_readable_int(text: str) -> int:
    """``1k`` = 1000, ``1K`` = 1024, ``25.6k`` = 25600, ``2m`` = 2000000, ``2M`` = 2 * 1024**2.

    Lower-case suffixes are powers of 1000, upper-case ones powers of 1024 (as in vLLM).
    """
    match = _HUMAN_INT.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: expected an integer, optionally with a k/m/g/t (x1000) "
            "or K/M/G/T (x1024) suffix, e.g. 4096, 32k, 25.6k or 32K"
        )
    number, suffix = match.groups()
    try:
        value = Decimal(number)
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimal numbers
        raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
    if suffix:
        base = 1000 if suffix.islower() else 1024
        value *= base ** _EXPONENTS[suffix.lower()]
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: not a whole number of tokens")
    return int(value)


def _add_frontend_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("frontend")
    group.add_argument(
        "--host", default=None, help="Address to listen on (default: all addresses)."
    )
    group.add_argument(
        "--grpc-port",
        type=int,
        default=DEFAULT_GRPC_PORT,
        help=f"gRPC port; the gRPC server is always on (default: {DEFAULT_GRPC_PORT}).",
    )
    group.add_argument(
        "--port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help=f"Port of the OpenAI-compatible REST gateway (default: {DEFAULT_HTTP_PORT}). "
        "Accepted but not served yet: the gateway is not part of this build, and a warning "
        "says so at start-up.",
    )
    group.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="Logging level (default: info).",
    )


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Model to serve (the same as --model): a local folder holding config.json, or a "
        ".gguf file. Default: the packaged SmolLM2-135M-Instruct.",
    )
    group.add_argument("--model", default=None, help="Model to serve; see MODEL.")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Name(s) clients use in the model field; the first is the default. "
        "Default: the --model string, or SmolLM2-135M-Instruct for the packaged model.",
    )
    group.add_argument(
        "--tokenizer", default=None, help="Tokenizer folder or .gguf file (default: the model's)."
    )
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="Weight and activation dtype (default: auto: bfloat16 unless the checkpoint is "
        "float16).",
    )
    group.add_argument(
        "--max-model-len",
        type=human_readable_int,
        default=None,
        help="Context window in tokens (prompt plus output); takes 1k/1K/25.6k/2m: lower case "
        "is powers of 1000, upper case powers of 1024 (default: the model's own).",
    )
    group.add_argument("--seed", type=int, default=0, help="Random seed (default: 0).")
    group.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="How to read the weights; dummy = random weights, for tests and benchmarks "
        "(default: auto).",
    )


def _add_cache_and_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    cache = parser.add_argument_group("KV cache")
    cache.add_argument(
        "--block-size", type=int, default=16, help="Tokens per KV cache block (default: 16)."
    )
    cache.add_argument(
        "--kv-cache-memory",
        type=float,
        default=4.0,
        metavar="GIB",
        help="(llmrpc) GiB of host memory for the KV cache when no GPU is used; it sets the "
        "number of KV blocks (default: 4).",
    )
    cache.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="Exact number of KV cache blocks, overriding --kv-cache-memory.",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse the KV cache of shared prompt prefixes (default: on).",
    )
    scheduler = parser.add_argument_group("scheduler")
    scheduler.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="Most requests in one batch (default: 256).",
    )
    scheduler.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="Most tokens computed in one engine step (default: 2048).",
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    _add_frontend_arguments(parser)
    _add_cache_and_scheduler_arguments(parser)


def _model_of(args: argparse.Namespace) -> str | None:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(
            f"--model {args.model!r} and the positional MODEL {args.model_tag!r} disagree; "
            "give the model once"
        )
    return args.model_tag or args.model


def build_configs(args: argparse.Namespace) -> tuple[EngineConfig, FrontendConfig]:
    """The typed configurations for parsed ``serve`` arguments; raises ValueError naming a flag."""
    model = ModelConfig(
        model=_model_of(args),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        load_format=args.load_format,
        served_model_name=tuple(args.served_model_name or ()),
    )
    cache = CacheConfig(
        block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    frontend = FrontendConfig(host=args.host, grpc_port=args.grpc_port, port=args.port)
    return EngineConfig(model=model, cache=cache, scheduler=scheduler), frontend


def warn_about_inert_options(frontend: FrontendConfig, logger: logging.Logger) -> None:
    """One warning line per option accepted without effect in this build."""
    logger.warning(
        "--port %d: the OpenAI-compatible REST gateway is not served yet; this build serves "
        "gRPC only (--grpc-port %d)",
        frontend.port,
        frontend.grpc_port,
    )


def configs_or_exit(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[EngineConfig, FrontendConfig]:
    """``build_configs``, or exit with status 2 and one line naming the flag."""
    try:
        return build_configs(args)
    except ValueError as error:
        parser.error(str(error))
