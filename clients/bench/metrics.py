"""From per-request measurements to the benchmark's figures, its printed table and its JSON.

Throughputs divide by the wall time of the whole run (first send to last reply). Latencies are
in milliseconds: TTFT per request; TPOT per request as (latency - TTFT) / (output tokens - 1),
for requests with more than one output token; ITL over every gap of every request.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from llmrpc.clients.bench.backends import RequestResult

PERCENTILES = (50, 90, 99)
_MAX_ERRORS_LISTED = 5


def distribution(values_s: list[float]) -> dict[str, float]:
    """Mean and percentiles, in milliseconds, of values given in seconds (zeros if none)."""
    if not values_s:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    ms = np.asarray(values_s) * 1000.0
    return {
        "mean": float(ms.mean()),
        **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES},
    }


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """TTFT, TPOT, ITL and end-to-end latency samples in seconds, over successful requests."""
    done = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }


def summarize(results: list[RequestResult], duration_s: float, config: dict) -> dict:
    """Everything ``bench serve`` reports, JSON-ready."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    errors = Counter(r.error for r in results if not r.success)
    samples = latency_samples(results)
    return {
        "config": config,
        "duration_s": duration_s,
        "completed": len(done),
        "errors": sum(errors.values()),
        "error_messages": [message for message, _ in errors.most_common(_MAX_ERRORS_LISTED)],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        **{f"{name}_ms": distribution(values) for name, values in samples.items()},
        # In the order the requests were sent: with --concurrency 1 the first paid for a cold
        # prefix cache, the rest may find a shared prefix there.
        "ttft_ms_by_request": [r.ttft * 1000.0 if r.success else None for r in results],
    }


def acceptance(counts) -> dict:
    """A run's speculative decoding counts (``SpecDecode``), JSON-ready."""
    return {
        "num_drafts": counts.num_drafts,
        "num_draft_tokens": counts.num_draft_tokens,
        "num_accepted_tokens": counts.num_accepted_tokens,
        "accepted_per_pos": list(counts.accepted_per_pos),
        "acceptance_rate": counts.acceptance_rate,
        "mean_accepted_length": counts.mean_accepted_length,
    }


def format_table(summary: dict) -> str:
    """The summary as an aligned two-column table, for the terminal."""
    config = summary["config"]
    rows = [
        ("Backend", config["backend"]),
        ("Concurrency", config["concurrency"]),
        ("Request rate (req/s)", config["request_rate"]),
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["errors"]),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        stats = summary[f"{name}_ms"]
        rows.append((f"{title} (ms) mean / p50 / p90 / p99", _quartet(stats)))
    spec = summary.get("speculative")
    if spec is not None and spec["num_draft_tokens"]:
        rows.append(("Draft acceptance rate", f"{spec['acceptance_rate']:.1%}"))
        rows.append(("Mean accepted length", f"{spec['mean_accepted_length']:.2f}"))
    elif spec is not None:
        rows.append(("Draft acceptance rate", "no drafts proposed"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    rule = "=" * max(len(line) for line in lines)
    return "\n".join([rule, *lines, rule])


def _quartet(stats: dict[str, float]) -> str:
    return " / ".join(f"{stats[key]:.2f}" for key in ("mean", "p50", "p90", "p99"))


def comparison(runs: list[dict], baseline_runs: list[dict]) -> dict:
    """Rounds of runs against a server and a baseline: the output throughput ratio of each
    round (server / baseline), their median and mean, and every run's summary."""
    ratios = [
        run["output_throughput"] / base["output_throughput"] if base["output_throughput"] else 0.0
        for run, base in zip(runs, baseline_runs, strict=True)
    ]
    return {
        "throughput_ratios": ratios,
        "throughput_ratio_median": float(np.median(ratios)),
        "throughput_ratio_mean": float(np.mean(ratios)),
        "errors": sum(run["errors"] for run in (*runs, *baseline_runs)),
        "runs": runs,
        "baseline_runs": baseline_runs,
    }


def format_comparison(summary: dict) -> str:
    """One line per round (each server's throughput, TTFT and TPOT p50), then the ratios."""
    lines = []
    pairs = zip(
        summary["runs"], summary["baseline_runs"], summary["throughput_ratios"], strict=True
    )
    for round_, (run, base, ratio) in enumerate(pairs, 1):
        lines.append(f"round {round_}: {_brief(run)} | baseline {_brief(base)} | ratio {ratio:.3f}")
    lines.append(
        f"output throughput ratio (server / baseline): median "
        f"{summary['throughput_ratio_median']:.3f}, mean {summary['throughput_ratio_mean']:.3f}, "
        f"failed requests {summary['errors']}"
    )
    return "\n".join(lines)


def _brief(run: dict) -> str:
    spec, accepted = run.get("speculative"), ""
    if spec is not None:
        share = f"{spec['acceptance_rate']:.0%}" if spec["num_draft_tokens"] else "none proposed"
        accepted = f", drafts accepted {share}"
    return (
        f"{run['config']['backend']} {run['output_throughput']:.1f} tok/s, "
        f"TTFT p50 {run['ttft_ms']['p50']:.0f} ms, TPOT p50 {run['tpot_ms']['p50']:.1f} ms"
        f"{accepted}"
    )
