"""Prometheus metrics at ``/metrics`` under vLLM's names, so vLLM's dashboards work unchanged.

Request figures (latencies, token counts, finish reasons) are the gateway's own measurements of
the requests it served; the engine figures (running, waiting, KV cache usage, prefix cache hit
rate) come from each replica's ``AdminService.GetLoad`` at scrape time: running and waiting are
summed over the serving replicas, the fractions averaged. Each gateway has its own registry.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from llmrpc.clients import Load
from llmrpc.clients.types import SpecDecode

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class GatewayMetrics:
    """The gauges, counters and histograms, labelled with the default model's served name."""

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series, as vLLM
        self.registry = CollectorRegistry()
        self.model_name = ""
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the batch.", labels, registry=r
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued.", labels, registry=r)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage (1 means full).", labels, registry=r
        )
        self.prefix_hit_rate = Gauge(
            "vllm:gpu_prefix_cache_hit_rate", "Prefix cache hit rate since start.", labels,
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.success = Counter(
            "vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r
        )
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "Request latency.")
        self.tpot = self._histogram(
            "vllm:time_per_output_token_seconds", "Mean time per output token after the first."
        )
        self.request_prompt = self._histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.request_generation = self._histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )

        self.kv_cache_bytes = Gauge(
            "llmrpc:kv_cache_bytes", "Bytes the KV cache holds.", labels, registry=r
        )
        self.device_memory_used = Gauge(
            "llmrpc:device_memory_used_bytes",
            "CUDA device memory in use by every process (0 on the CPU).", labels, registry=r,
        )  # fmt: skip
        self.device_memory_total = Gauge(
            "llmrpc:device_memory_total_bytes", "CUDA device memory in all (0 on the CPU).",
            labels, registry=r,
        )  # fmt: skip
        self.device_utilization = Gauge(
            "llmrpc:device_utilization",
            "Share of time a CUDA kernel ran, mean of the replicas reporting it (NVML).",
            labels, registry=r,
        )  # fmt: skip
        self.spec_decode = _SpecDecodeCounters(self)
        r.register(self.spec_decode)

    def _histogram(self, name: str, documentation: str, buckets=_LATENCY_BUCKETS) -> Histogram:
        return Histogram(
            name, documentation, ["model_name"], buckets=buckets, registry=self.registry
        )

    def set_load(self, loads: list[Load]) -> None:
        name = self.model_name
        self.running.labels(name).set(sum(load.num_running_requests for load in loads))
        self.waiting.labels(name).set(sum(load.num_waiting_requests for load in loads))
        count = max(len(loads), 1)
        self.kv_usage.labels(name).set(sum(load.kv_cache_usage for load in loads) / count)
        hit_rate = sum(load.prefix_cache_hit_rate for load in loads) / count
        self.prefix_hit_rate.labels(name).set(hit_rate)
        self.kv_cache_bytes.labels(name).set(sum(load.kv_cache_bytes for load in loads))
        used = sum(load.device_memory_used_bytes for load in loads)
        self.device_memory_used.labels(name).set(used)
        total = sum(load.device_memory_total_bytes for load in loads)
        self.device_memory_total.labels(name).set(total)
        reported = [load.device_utilization for load in loads]
        reported = [u for u in reported if u is not None]
        if reported:
            self.device_utilization.labels(name).set(sum(reported) / len(reported))
        self.spec_decode.set([load.spec_decode for load in loads if load.spec_decode])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodeCounters:
    """vLLM's ``vllm:spec_decode_*`` counters: the replicas' own totals since their start
    (GetLoad), added up, exposed only where some replica speculates."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.counts: list[SpecDecode] = []

    def set(self, counts: list[SpecDecode]) -> None:
        self.counts = counts

    def describe(self):
        return []  # collected at scrape time only: the names depend on what replicas report

    def collect(self):
        if not self.counts:
            return
        labels = [self.metrics.model_name]
        for suffix, field, documentation in (
            ("num_drafts", "num_drafts", "Proposals verified."),
            ("num_draft_tokens", "num_draft_tokens", "Draft tokens verified."),
            ("num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
        ):
            family = CounterMetricFamily(
                f"vllm:spec_decode_{suffix}", documentation, labels=["model_name"]
            )
            family.add_metric(labels, sum(getattr(c, field) for c in self.counts))
            yield family
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            labels=["model_name", "position"],
        )
        longest = max(len(c.accepted_per_pos) for c in self.counts)
        for position in range(longest):
            total = sum(
                c.accepted_per_pos[position]
                for c in self.counts
                if position < len(c.accepted_per_pos)
            )
            per_position.add_metric([*labels, str(position)], total)
        yield per_position


class RequestTimer:
    """One request's timings; ``finish`` records them with its token counts."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token: float | None = None

    def tokens_arrived(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def finish(self, prompt_tokens: int, generation_tokens: int, reasons: list[str]) -> None:
        m, name = self.metrics, self.metrics.model_name
        now = time.perf_counter()
        first = self.first_token or now
        m.e2e.labels(name).observe(now - self.start)
        m.ttft.labels(name).observe(first - self.start)
        if generation_tokens > 1:
            m.tpot.labels(name).observe((now - first) / (generation_tokens - 1))
        m.prompt_tokens.labels(name).inc(prompt_tokens)
        m.generation_tokens.labels(name).inc(generation_tokens)
        m.request_prompt.labels(name).observe(prompt_tokens)
        m.request_generation.labels(name).observe(generation_tokens)
        for reason in reasons:
            m.success.labels(name, reason).inc()
