"""``llmrpc bench serve``: load a running server (ours over gRPC, or any OpenAI-compatible one)
with streamed requests at a set concurrency and arrival rate, and report what a user sees.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import math
import random
import ssl
import sys
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from llmrpc.clients.async_client import AsyncClient
from llmrpc.clients.bench import datasets, metrics
from llmrpc.clients.bench.backends import (
    GrpcBackend,
    OpenAIBackend,
    RequestResult,
    vocab_size_of_folder,
)
from llmrpc.clients.cli import common

DEFAULT_URLS = {"grpc": "localhost:50051", "openai": "http://localhost:8000"}
DEFAULT_ROUNDS = 3  # with --baseline-url


class BenchError(common.CommandError):
    """The benchmark cannot run as asked (server unreachable, bad dataset...)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=("grpc", "openai"),
        default="grpc",
        help="grpc: an llmrpc server, --url host:port (default); openai: any OpenAI-compatible "
        "server, --url http://host:port.",
    )
    parser.add_argument("--model", default="", help="Model to ask for (default: the server's).")
    parser.add_argument("--num-prompts", type=int, default=100, help="Default 100.")
    parser.add_argument(
        "--concurrency",
        "--max-concurrency",
        type=int,
        help="Most requests in flight at once (default: no limit).",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Mean arrivals per second, Poisson-distributed (default: inf, all at once).",
    )
    parser.add_argument("--input-len", type=int, default=128, help="Random prompt tokens (128).")
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="Random dataset: this many tokens, the same for every prompt, before each prompt's "
        "own --input-len tokens (a shared system prompt, to measure prefix caching). Default 0.",
    )
    parser.add_argument("--output-len", type=int, default=128, help="Tokens per output (128).")
    parser.add_argument(
        "--dataset", default="random", help="random, or a ShareGPT-format JSON file."
    )
    parser.add_argument("--seed", type=int, default=0, help="Prompts and arrivals.")
    parser.add_argument("--temperature", type=float, default=0.0, help="Default 0: greedy.")
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="Let EOS end outputs early (by default outputs are exactly --output-len tokens).",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="openai backend, random prompts: the vocabulary size. Default: the server's "
        "(GET /get_tokenizer_info's vocab_size, as llmrpc's gateway gives it with "
        "--enable-tokenizer-info-endpoint), else the config.json of the model folder "
        "GET /v1/models names, when it is on this machine (as vLLM names it), else the gRPC "
        "baseline's.",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="MODEL_DIR",
        help="openai backend: a model folder whose config.json gives the vocabulary size.",
    )
    parser.add_argument("--output-json", type=Path, help="Write the results here as JSON.")
    parser.add_argument("--plot", type=Path, help="Draw the latency distributions to a PNG.")
    comparison = parser.add_argument_group(
        "comparison with a baseline (one run, alternating servers)",
        "With --baseline-url, each round runs the same load once against --url and once against "
        "the baseline, in alternating order, and reports the output throughput ratio of each "
        "round (--url / baseline) and their median. Every run draws its own prompts (--seed plus "
        "the run's number), so no run finds another's prompts in a prefix cache.",
    )
    comparison.add_argument("--baseline-url", help="The baseline server's address.")
    comparison.add_argument(
        "--baseline-backend", choices=("grpc", "openai"), help="Its backend (default: --backend)."
    )
    comparison.add_argument("--rounds", type=int, help="Rounds (default 3).")
    common.add_connection_arguments(parser, default_target=None)


def _openai_http(args: argparse.Namespace) -> tuple[aiohttp.ClientSession, str]:
    """The HTTP session of the openai backend, and the API's base URL (ending in /v1)."""
    base = args.target.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise BenchError(f"--url {base!r}: the openai backend needs an http:// or https:// URL")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    verify: ssl.SSLContext | bool = True
    if args.ca_cert or args.client_cert:
        verify = ssl.create_default_context(cafile=args.ca_cert)
        if args.client_cert:
            verify.load_cert_chain(args.client_cert, args.client_key)
    session = aiohttp.ClientSession(
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=args.timeout),  # None: no limit, as long outputs need
        # Each request on a connection of its own (limit 0: no limit). A server may close a
        # kept-alive connection after a streamed reply without saying so, and a request sent on it
        # is lost: llama.cpp's server lost 15-24 of 96 streamed requests, 32 at once, to a client
        # that kept its connections, and its throughput counted only the rest.
        connector=aiohttp.TCPConnector(ssl=verify, limit=args.concurrency or 0, force_close=True),
    )
    return session, base if base.endswith("/v1") else f"{base}/v1"


def make_backend(args: argparse.Namespace) -> GrpcBackend | OpenAIBackend:
    args.target = args.target or DEFAULT_URLS[args.backend]
    if args.backend == "openai":
        vocab_size = args.vocab_size or vocab_size_of_folder(args.tokenizer or args.model)
        if args.tokenizer and vocab_size is None:
            message = f"--tokenizer {args.tokenizer}: no config.json with a vocab_size there"
            raise BenchError(message, common.EXIT_USAGE)
        session, base_url = _openai_http(args)
        return OpenAIBackend(
            session, base_url, args.model, vocab_size, args.ignore_eos, args.temperature
        )
    client = common.client_from_args(args, args.model, AsyncClient)
    return GrpcBackend(client, args.ignore_eos, args.temperature)


async def load_requests(args, backend, seed: int) -> list[datasets.BenchRequest]:
    if args.dataset != "random":
        return datasets.sharegpt_requests(args.dataset, args.num_prompts, args.output_len, seed)
    vocab_size = args.vocab_size or await backend.vocab_size()
    return datasets.random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        vocab_size,
        seed,
        args.shared_prefix_len,
    )


async def _arrivals(requests, rate: float, seed: int):
    """Requests at Poisson-distributed times of mean rate ``rate`` (all at once if infinite)."""
    rng = random.Random(seed)
    for index, request in enumerate(requests):
        if index and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        yield request


async def drive(backend, requests, args) -> tuple[list[RequestResult], float]:
    """Send every request, at most ``--concurrency`` at once; the results and the wall time."""
    limit = asyncio.Semaphore(args.concurrency or len(requests))
    progress = tqdm(total=len(requests), desc="bench", unit="req", file=sys.stderr)

    async def send(request) -> RequestResult:
        async with limit:
            result = await backend.send(request)
        progress.update(1)
        return result

    start = time.perf_counter()
    tasks = [
        asyncio.create_task(send(request))
        async for request in _arrivals(requests, args.request_rate, args.seed)
    ]
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


async def _check(backend) -> None:
    """One short request first, so a wrong address, key or model fails fast and clearly."""
    result = await backend.send(datasets.BenchRequest("Hello", output_len=2))
    if not result.success:
        raise BenchError(f"the first test request failed: {result.error}")


def run_config(args: argparse.Namespace, model: str) -> dict:
    return {
        "backend": args.backend,
        "url": args.target,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "concurrency": args.concurrency or "unlimited",
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "input_len": args.input_len if args.dataset == "random" else None,
        "shared_prefix_len": args.shared_prefix_len if args.dataset == "random" else None,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
    }


async def benchmark(args: argparse.Namespace) -> tuple[dict, list[RequestResult]]:
    backend = make_backend(args)
    try:
        model = await backend.model_name()
        await _check(backend)
        return await _run(args, backend, model, backend, args.seed)
    except aiohttp.ClientError as error:  # openai backend: nothing listens there, or it refused
        raise BenchError(f"{args.target}: {error}", common.EXIT_UNAVAILABLE) from None
    finally:
        await backend.close()


async def _run(args, backend, model: str, vocab_source, seed: int):
    """One measured run: ``--num-prompts`` requests drawn with ``seed``; summary and results."""
    requests = await load_requests(args, vocab_source, seed)
    before = await backend.spec_counts()
    results, duration = await drive(backend, requests, args)
    after = await backend.spec_counts()
    config = {**run_config(args, model), "seed": seed}
    summary = metrics.summarize(results, duration, config)
    if before is not None and after is not None:  # a server that speculates: this run's share
        summary["speculative"] = metrics.acceptance(after - before)
    return summary, results


async def compare(args: argparse.Namespace) -> dict:
    """``--rounds`` rounds of one run against ``--url`` and one against the baseline."""
    baseline_args = copy.copy(args)
    baseline_args.backend = args.baseline_backend or args.backend
    baseline_args.target = args.baseline_url
    pairs = [(args, make_backend(args)), (baseline_args, make_backend(baseline_args))]
    runs: tuple[list[dict], list[dict]] = ([], [])
    try:
        models = [await backend.model_name() for _, backend in pairs]
        for _, backend in pairs:
            await _check(backend)
        vocab_source = await _knows_vocab_size([backend for _, backend in pairs])
        for round_ in range(args.rounds or DEFAULT_ROUNDS):
            order = (0, 1) if round_ % 2 == 0 else (1, 0)  # alternate who goes first
            for which in order:
                run_args, backend = pairs[which]
                seed = args.seed + 2 * round_ + which
                summary, _ = await _run(run_args, backend, models[which], vocab_source, seed)
                runs[which].append(summary)
    except aiohttp.ClientError as error:  # openai backend: nothing listens there, or it refused
        raise BenchError(str(error), common.EXIT_UNAVAILABLE) from None
    finally:
        for _, backend in pairs:
            await backend.close()
    return metrics.comparison(*runs)


async def _knows_vocab_size(backends: list):
    """The first backend that can tell the vocabulary size (an openai one needs flags for it;
    the first one's error names them)."""
    for backend in backends:
        with contextlib.suppress(ValueError):
            await backend.vocab_size()
            return backend
    return backends[0]


def _plot_module():
    """``bench.plot``, imported only for --plot (matplotlib is an optional dependency); checked
    before the run, so a missing matplotlib does not waste one."""
    try:
        from llmrpc.clients.bench import plot
    except ImportError as error:
        message = f"--plot needs matplotlib ({error}); install it with: pip install 'llmrpc[bench]'"
        raise BenchError(message, common.EXIT_USAGE) from None
    return plot


def main(args: argparse.Namespace) -> int:
    if args.baseline_url is not None:
        return _main_compare(args)
    if args.rounds is not None or args.baseline_backend is not None:
        raise BenchError("--rounds and --baseline-backend need --baseline-url", common.EXIT_USAGE)
    plot = _plot_module() if args.plot else None
    summary, results = asyncio.run(benchmark(args))
    print(metrics.format_table(summary))
    if args.output_json:
        args.output_json.write_text(json.dumps(summary, indent=2) + "\n")
    if plot is not None:
        plot.draw(metrics.latency_samples(results), summary["config"], args.plot)
    return common.EXIT_OK if summary["errors"] == 0 else common.EXIT_SERVER_ERROR


def _main_compare(args: argparse.Namespace) -> int:
    if args.plot or (args.rounds is not None and args.rounds < 1):
        message = "--baseline-url takes --rounds 1 or more, and no --plot"
        raise BenchError(message, common.EXIT_USAGE)
    summary = asyncio.run(compare(args))
    print(metrics.format_comparison(summary))
    if args.output_json:
        args.output_json.write_text(json.dumps(summary, indent=2) + "\n")
    return common.EXIT_OK if summary["errors"] == 0 else common.EXIT_SERVER_ERROR
