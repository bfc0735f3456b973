"""Per-request cost of --otlp-traces-endpoint: the same short requests through the gRPC API of
two servers in one run, one traced (exporting to an in-process OTLP receiver) and one not.

    python tests/server/tracing_overhead.py [--model DIR] [--requests 200] [--detailed]

Both servers run the engine core in a process of its own (the default); requests are sequential
(one in flight), 1 output token each, one to each server in turn, so that the machine's noise
falls on both. Prints JSON: mean and median milliseconds per request, the traced/untraced
ratio, the median of the paired differences, and the time the tracing work of one call takes
alone in the server (span_building_us_per_request). The default model is the packaged
SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: otlp_receiver

from otlp_receiver import OtlpReceiver  # noqa: E402

from llmrpc.engine.config import EngineConfig, ModelConfig  # noqa: E402
from llmrpc.engine.loading.loader import resolve_model_dir  # noqa: E402
from llmrpc.server.app import start_server  # noqa: E402
from llmrpc.server.settings import FrontendConfig  # noqa: E402
from llmrpc.server.tracing_config import TracingConfig  # noqa: E402
from llmrpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402

REQUEST = generation_pb2.GenerateRequest(
    text="The capital of France is",
    sampling=common_pb2.SamplingParams(temperature=0.0),
    stopping=common_pb2.StoppingCriteria(max_tokens=1, ignore_eos=True),
)


async def timed_requests(stub, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        await stub.Generate(REQUEST)
        seconds.append(time.perf_counter() - started)
    return seconds


def summary(seconds: list[float]) -> dict:
    return {
        "requests": len(seconds),
        "mean_ms": round(1000 * statistics.fmean(seconds), 3),
        "median_ms": round(1000 * statistics.median(seconds), 3),
    }


async def measure(model: str, requests: int, detailed: bool) -> dict:
    receiver = OtlpReceiver()
    engine = EngineConfig(model=ModelConfig(model=model))
    tracing = TracingConfig(receiver.endpoint, ("all",) if detailed else None)
    configs = {
        "untraced": FrontendConfig(host="127.0.0.1", grpc_port=0),
        "traced": FrontendConfig(host="127.0.0.1", grpc_port=0, tracing=tracing),
    }
    servers = {name: await start_server(engine, frontend=cfg) for name, cfg in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in servers}
    try:
        channels = {n: grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for n, s in servers.items()}
        stubs = {n: generation_pb2_grpc.GenerationServiceStub(c) for n, c in channels.items()}
        for stub in stubs.values():  # warm both: connection, first-call paths
            await timed_requests(stub, 10)
        order = list(stubs)
        for _ in range(requests):  # one request each in turn, the order swapped every time
            for name in order:
                times[name] += await timed_requests(stubs[name], 1)
            order.reverse()
    finally:
        for server in servers.values():
            await server.stop(grace=1)
    received = sum(s.name == "llm_request" for s in receiver.spans())
    result = {name: summary(seconds) for name, seconds in times.items()}
    result["traced_over_untraced_mean"] = round(
        result["traced"]["mean_ms"] / result["untraced"]["mean_ms"], 4
    )
    result["traced_minus_untraced_mean_ms"] = round(
        result["traced"]["mean_ms"] - result["untraced"]["mean_ms"], 3
    )
    paired = [t - u for t, u in zip(times["traced"], times["untraced"], strict=True)]
    result["median_paired_difference_ms"] = round(1000 * statistics.median(paired), 3)
    result["llm_request_spans_received"] = received
    result["collect_detailed_traces"] = "all" if detailed else None
    result["span_building_us_per_request"] = span_building_us(receiver.endpoint)
    receiver.stop()
    return result


def span_building_us(endpoint: str, count: int = 2000) -> float:
    """The tracing work one traced generation call does on the server's event loop, alone: its
    SERVER span, the engine's request and phase spans, handed to the batch exporter."""
    from opentelemetry.trace import SpanKind

    from llmrpc.common import tracing as otlp
    from llmrpc.engine.request import FinishReason, RequestOutput, SamplingParams
    from llmrpc.engine.timings import RequestTimings
    from llmrpc.server.tracing import ServerTracing, TracedCall

    tracing = ServerTracing(TracingConfig(endpoint, ("all",)))
    now = time.time()
    timings = RequestTimings(now, now + 0.001, now + 0.002, now + 0.003, now + 0.004, 2, 1, 1, 1)
    output = RequestOutput("id", "", [1], True, FinishReason.LENGTH, timings=timings)
    started = time.perf_counter()
    for _ in range(count):
        with tracing.tracer.start_as_current_span("call", kind=SpanKind.SERVER) as span:
            call = TracedCall(tracing, span, "id")
            call.ask_timings(SamplingParams(), "model")
            call.engine_spans(output)
    elapsed = time.perf_counter() - started
    otlp.release(endpoint)
    return round(1e6 * elapsed / count, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: the packaged SmolLM2)")
    parser.add_argument("--requests", type=int, default=200, help="per server")
    parser.add_argument("--detailed", action="store_true", help="--collect-detailed-traces all")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = args.model or str(resolve_model_dir(None))
    result = asyncio.run(measure(model, args.requests, args.detailed))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
