"""``llmrpc bench``: serve over gRPC and over an OpenAI-compatible stand-in, the JSON and the
plot it writes, and throughput against the Transformers baseline. Numbers are checked for
consistency (token counts add up, percentiles are ordered), never for speed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from client_utils import ServerThread, tiny_engine_config
from openai_standin import OpenAIStandIn

from llmrpc.clients import Client
from llmrpc.clients.bench import metrics
from llmrpc.clients.bench.backends import RequestResult, spec_counts_of_metrics
from llmrpc.clients.cli import common
from llmrpc.clients.types import SpecDecode
from llmrpc.engine.spec_decode.config import SpeculativeConfig

LLMRPC = str(Path(sys.executable).parent / "llmrpc")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LLMRPC, "bench", *args], capture_output=True, text=True, timeout=300)


async def bench_async(*args: str) -> tuple[int, str, str]:
    """``bench`` in a subprocess while this event loop keeps serving (the OpenAI stand-in)."""
    process = await asyncio.create_subprocess_exec(
        LLMRPC, "bench", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=300)
    return process.returncode, stdout.decode(), stderr.decode()


@contextlib.contextmanager
def running_gateway(backend: str, port: int, *flags: str):
    """A real ``llmrpc gateway`` in front of ``backend``, serving on ``port``; its base URL."""
    command = [LLMRPC, "gateway", "--backend", backend, "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--uvicorn-log-level", "warning", *flags], stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _healthy(url):
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the gateway did not become healthy"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.communicate(timeout=30)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


@pytest.fixture(scope="module")
def named_server(tiny_llama_dir):
    """The tiny model served as "tiny": a name, not a folder a client could read."""
    config = tiny_engine_config(tiny_llama_dir)
    model = replace(config.model, served_model_name=("tiny",))
    server = ServerThread(replace(config, model=model), host="127.0.0.1", port=0)
    yield server
    server.stop()


def assert_consistent(
    summary: dict, num_prompts: int, output_len: int, one_message_each: bool = False
) -> None:
    """``one_message_each``: outputs so short that each may arrive whole in one message (the
    engine merges the tokens a slow reader has not taken yet), leaving no inter-token gap."""
    assert (summary["completed"], summary["errors"]) == (num_prompts, 0)
    assert summary["total_output_tokens"] == num_prompts * output_len
    duration = summary["duration_s"]
    assert summary["output_throughput"] * duration == pytest.approx(num_prompts * output_len)
    assert summary["request_throughput"] * duration == pytest.approx(num_prompts)
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = summary[name]
        if name == "itl_ms" and one_message_each and stats["mean"] == 0:
            continue  # no gap measured: every output came in one message
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], name
        assert stats["mean"] > 0, name
    assert summary["ttft_ms"]["p99"] <= summary["e2el_ms"]["p99"]


def test_serve_over_grpc_writes_json_and_a_plot(server, tmp_path):
    out, plot = tmp_path / "result.json", tmp_path / "latency.png"
    result = bench(
        "serve", "--backend", "grpc", "--url", server.address, "--num-prompts", "6",
        "--concurrency", "3", "--input-len", "16", "--output-len", "8", "--seed", "1",
        "--output-json", str(out), "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert_consistent(summary, num_prompts=6, output_len=8)
    assert summary["total_input_tokens"] == 6 * 16
    assert summary["config"]["concurrency"] == 3
    assert "Output token throughput (tok/s)" in result.stdout
    assert plot.read_bytes().startswith(PNG_SIGNATURE)


def test_serve_with_a_sharegpt_file_and_a_request_rate(server, tmp_path):
    prompts = ["Tell me about the sea.", "What is a prime number?"]
    conversations = [
        {"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "..."}]}
        for p in prompts
    ] + [{"conversations": [{"from": "gpt", "value": "a reply with no question"}]}]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    out = tmp_path / "result.json"
    result = bench(
        "serve", "--url", server.address, "--dataset", str(dataset), "--num-prompts", "2",
        "--request-rate", "20", "--output-len", "5", "--output-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    # 5 tokens of a tiny model: seen (clean-clone run) to arrive whole in one message each
    assert_consistent(summary, num_prompts=2, output_len=5, one_message_each=True)
    with Client(server.address) as client:
        assert summary["total_input_tokens"] == sum(client.tokenize(p).count for p in prompts)


@pytest.mark.parametrize("unannounced_close", [False, True])
async def test_serve_over_the_openai_api(server, tmp_path, unannounced_close):
    """With ``unannounced_close`` the server closes a kept-alive connection after a streamed reply
    without saying so: a request the client sent on it would be lost, and counted against that
    server's throughput. Each request takes a connection of its own."""
    standin = OpenAIStandIn(server.address, unannounced_close)
    port = await standin.start()
    out = tmp_path / "result.json"
    try:
        code, stdout, stderr = await bench_async(
            "serve", "--backend", "openai", "--url", f"http://127.0.0.1:{port}",
            "--vocab-size", "49152", "--num-prompts", "4", "--concurrency", "2",
            "--input-len", "12", "--output-len", "6", "--output-json", str(out),
        )  # fmt: skip
    finally:
        await standin.stop()
    assert code == 0, stderr + stdout  # the table counts failed requests, with their errors
    summary = json.loads(out.read_text())
    assert_consistent(summary, num_prompts=4, output_len=6)
    assert (summary["completed"], summary["errors"], standin.num_dropped) == (4, 0, 0)
    assert summary["total_input_tokens"] == 4 * 12
    assert summary["config"]["model"] == server.running.engine.model_info.served_model_names[0]
    assert standin.num_completions == 5  # the first test request, then the four measured


OPENAI_LOAD = ["--num-prompts", "3", "--concurrency", "3", "--input-len", "12", "--output-len", "4"]


def test_serve_openai_asks_a_real_gateway_for_the_vocabulary_size(
    named_server, unused_tcp_port, tmp_path
):
    out = tmp_path / "result.json"
    flag = "--enable-tokenizer-info-endpoint"
    with running_gateway(named_server.address, unused_tcp_port, flag) as url:
        result = bench(
            "serve", "--backend", "openai", "--url", url, *OPENAI_LOAD, "--output-json", str(out)
        )
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert_consistent(summary, num_prompts=3, output_len=4)
    assert summary["total_input_tokens"] == 3 * 12
    assert summary["config"]["model"] == "tiny"


@pytest.mark.parametrize("fixture", ["server", "named_server"])
def test_serve_openai_reads_the_vocabulary_size_from_the_served_model_folder(
    fixture, request, unused_tcp_port, tmp_path
):
    """A server on this machine: /v1/models' root is the folder the model was loaded from (as
    vLLM's), whether the model is served by its path or under a name."""
    address = request.getfixturevalue(fixture).address
    out = tmp_path / "result.json"
    with running_gateway(address, unused_tcp_port) as url:
        result = bench(
            "serve", "--backend", "openai", "--url", url, *OPENAI_LOAD, "--output-json", str(out)
        )
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["total_input_tokens"] == 3 * 12


async def test_serve_openai_without_a_vocabulary_size_names_the_flag_in_one_line(named_server):
    """A server that publishes neither tokenizer facts nor a model folder (the stand-in, whose
    model list gives ids alone, here a name)."""
    standin = OpenAIStandIn(named_server.address)
    port = await standin.start()
    try:
        url = f"http://127.0.0.1:{port}"
        code, stdout, stderr = await bench_async(
            "serve", "--backend", "openai", "--url", url, *OPENAI_LOAD
        )
    finally:
        await standin.stop()
    assert (code, stdout) == (common.EXIT_USAGE, "")
    last_line = stderr.splitlines()[-1]  # after the progress bar's lines, if any
    assert last_line.startswith("llmrpc: error: ") and "--vocab-size" in last_line
    assert "--vocab-size" not in "\n".join(stderr.splitlines()[:-1])


async def test_serve_against_a_baseline_alternates_rounds_and_reports_ratios(server, tmp_path):
    standin = OpenAIStandIn(server.address)
    port = await standin.start()
    out = tmp_path / "comparison.json"
    try:  # no --vocab-size: the gRPC baseline tells it
        code, stdout, stderr = await bench_async(
            "serve", "--backend", "openai", "--url", f"http://127.0.0.1:{port}",
            "--baseline-backend", "grpc", "--baseline-url", server.address, "--rounds", "2",
            "--num-prompts", "4", "--concurrency", "2", "--input-len", "12", "--output-len", "6",
            "--seed", "5", "--output-json", str(out),
        )  # fmt: skip
    finally:
        await standin.stop()
    assert code == 0, stderr
    assert standin.num_completions == 1 + 2 * 4  # the check request, then two runs of four
    summary = json.loads(out.read_text())
    runs, baseline_runs = summary["runs"], summary["baseline_runs"]
    assert len(runs) == len(baseline_runs) == 2
    for run in (*runs, *baseline_runs):
        assert_consistent(run, num_prompts=4, output_len=6)
    # every run draws its own prompts: none finds another's in the prefix cache
    seeds = [run["config"]["seed"] for run in (*runs, *baseline_runs)]
    assert sorted(seeds) == [5, 6, 7, 8]
    pairs = zip(runs, baseline_runs, strict=True)
    expected = [run["output_throughput"] / base["output_throughput"] for run, base in pairs]
    assert summary["throughput_ratios"] == pytest.approx(expected)
    assert summary["throughput_ratio_median"] == pytest.approx(sum(expected) / 2)
    assert [run["config"]["backend"] for run in runs] == ["openai", "openai"]
    assert [run["config"]["backend"] for run in baseline_runs] == ["grpc", "grpc"]
    assert stdout.count("ratio") == 3  # one line per round, then the summary


def test_baseline_options_without_a_baseline_are_a_usage_error(server):
    result = bench("serve", "--url", server.address, "--rounds", "2", "--num-prompts", "1")
    assert result.returncode == common.EXIT_USAGE
    assert "--baseline-url" in result.stderr


def test_serve_with_no_server_exits_3(unused_tcp_port):
    result = bench("serve", "--url", f"127.0.0.1:{unused_tcp_port}", "--num-prompts", "1")
    assert result.returncode == common.EXIT_UNAVAILABLE
    assert "UNAVAILABLE" in result.stderr


def test_throughput_against_the_transformers_baseline(tiny_llama_dir, tmp_path):
    out = tmp_path / "result.json"
    result = bench(
        "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32", "--num-prompts", "4",
        "--input-len", "16", "--output-len", "8", "--kv-cache-memory", "0.05",
        "--baseline", "transformers", "--repeats", "2", "--output-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "engine / transformers output throughput:" in result.stdout
    results = json.loads(out.read_text())
    assert results["engine"]["output_tokens"] == results["transformers"]["output_tokens"] == 32
    ratio = results["engine"]["output_throughput"] / results["transformers"]["output_throughput"]
    assert results["ratio"] == pytest.approx(ratio)
    assert results["config"]["dtype"] == "float32"


def test_throughput_with_half_the_prompts_held_to_a_schema_against_none(tiny_llama_dir, tmp_path):
    out, schema = tmp_path / "result.json", tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
    result = bench(
        "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32", "--num-prompts", "4",
        "--input-len", "8", "--output-len", "6", "--kv-cache-memory", "0.05",
        "--json-schema", str(schema), "--baseline", "free", "--output-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "engine / free output throughput:" in result.stdout
    results = json.loads(out.read_text())
    assert results["engine"]["output_tokens"] == results["free"]["output_tokens"] == 24
    assert results["schema_compile_ms"] > 0
    missing = bench("throughput", "--model", str(tiny_llama_dir), "--baseline", "free")
    assert missing.returncode == common.EXIT_USAGE and "--json-schema" in missing.stderr


def test_throughput_of_a_quantized_engine(tiny_llama_dir, tmp_path):
    out = tmp_path / "result.json"
    result = bench(
        "throughput", "--model", str(tiny_llama_dir), "--dtype", "bfloat16", "-q", "int8",
        "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
        "--kv-cache-memory", "0.05", "--output-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    assert results["config"]["quantization"] == "int8"
    assert results["config"]["layers"] == {"Int8Linear": 9}  # 2 layers x 4 + lm_head


def test_throughput_of_a_compiled_engine(tiny_llama_dir, tmp_path):
    out = tmp_path / "result.json"
    result = bench(
        "throughput", "--model", str(tiny_llama_dir), "-O3", "--num-prompts", "2",
        "--input-len", "8", "--output-len", "4", "--kv-cache-memory", "0.05",
        "--output-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = json.loads(out.read_text())["config"]
    assert config["compilation_level"] == 3 and config["compiled"]


def test_throughput_with_the_roofline(tiny_llama_dir, tmp_path):
    out = tmp_path / "result.json"
    result = bench(
        "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32", "--num-prompts", "2",
        "--input-len", "8", "--output-len", "6", "--kv-cache-memory", "0.05", "--roofline",
        "--output-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "roofline: read" in result.stdout
    figures = json.loads(out.read_text())["roofline"]
    assert figures["batch"] == 2 and figures["context"] == 8 + 6 / 2
    assert figures["weight_bytes"] > 0 and figures["decode_tokens_per_second"] > 0
    assert figures["fraction"] == pytest.approx(
        figures["decode_tokens_per_second"] / figures["roofline_tokens_per_second"]
    )


@pytest.mark.parametrize("value", ['{"level": 3, "backend": "x"}', "{not json", "7"])
def test_throughput_compilation_errors_are_one_line(value):
    result = bench("throughput", "-O", value)
    assert result.returncode == common.EXIT_USAGE
    assert result.stderr.count("\n") == 1 and "--compilation-config" in result.stderr


def test_throughput_usage_errors_are_one_line():
    result = bench("throughput", "--num-prompts", "many")
    assert result.returncode == common.EXIT_USAGE
    assert result.stderr.count("\n") == 1 and "--num-prompts" in result.stderr


def test_summary_of_known_measurements():
    ok = RequestResult(
        success=True, prompt_len=4, output_len=11, ttft=0.1, itl=[0.1] * 10, latency=1.1
    )
    failed = RequestResult(error="UNAVAILABLE: gone")
    summary = metrics.summarize([ok, failed], duration_s=2.0, config={})
    assert (summary["completed"], summary["errors"]) == (1, 1)
    assert summary["error_messages"] == ["UNAVAILABLE: gone"]
    assert summary["output_throughput"] == pytest.approx(5.5)
    assert summary["total_token_throughput"] == pytest.approx(7.5)
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert summary["itl_ms"]["p99"] == pytest.approx(100.0)
    assert summary["e2el_ms"]["mean"] == pytest.approx(1100.0)


def test_shared_prefix_prompts_hit_the_prefix_cache(server, tmp_path):
    out = tmp_path / "prefix.json"
    hit_rate_before = Client(server.address).load().prefix_cache_hit_rate
    result = bench(
        "serve", "--backend", "grpc", "--url", server.address, "--num-prompts", "3",
        "--concurrency", "1", "--input-len", "8", "--shared-prefix-len", "64",
        "--output-len", "4", "--seed", "7", "--output-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert summary["total_input_tokens"] == 3 * (64 + 8)
    assert summary["config"]["shared_prefix_len"] == 64
    assert len(summary["ttft_ms_by_request"]) == 3
    # Prompts two and three find the 64-token prefix (4 of their 4.5 blocks): the server's
    # running hit rate goes up.
    assert Client(server.address).load().prefix_cache_hit_rate > hit_rate_before


def test_random_prompts_share_exactly_the_prefix():
    from llmrpc.clients.bench.datasets import random_requests

    requests = random_requests(4, 10, 2, vocab_size=1000, seed=3, shared_prefix_len=20)
    prefixes = {tuple(r.prompt[:20]) for r in requests}
    suffixes = {tuple(r.prompt[20:]) for r in requests}
    assert len(prefixes) == 1 and len(suffixes) == 4
    assert all(len(r.prompt) == 30 for r in requests)


@pytest.fixture(scope="module")
def speculating_server(tiny_llama_dir):
    """The tiny model with prompt-lookup speculation (its greedy loops are easy to predict)."""
    config = tiny_engine_config(tiny_llama_dir)
    speculative = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3})  # fmt: skip
    server = ServerThread(replace(config, speculative=speculative), host="127.0.0.1", port=0)
    yield server
    server.stop()


def _assert_acceptance(spec: dict) -> None:
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    assert spec["mean_accepted_length"] == 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
    per_position = spec["accepted_per_pos"]
    assert per_position[0] > 0 and per_position == sorted(per_position, reverse=True)
    assert sum(spec["accepted_per_pos"]) == spec["num_accepted_tokens"]


def test_serve_reports_a_speculating_servers_acceptance_over_grpc_and_a_gateway(
    speculating_server, unused_tcp_port, tmp_path
):
    out, load = tmp_path / "result.json", ["--num-prompts", "4", "--output-len", "24"]
    result = bench("serve", "--url", speculating_server.address, *load, "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    assert "Draft acceptance rate" in result.stdout and "Mean accepted length" in result.stdout
    summary = json.loads(out.read_text())
    assert_consistent(summary, num_prompts=4, output_len=24)
    _assert_acceptance(summary["speculative"])
    with Client(speculating_server.address) as client:
        counts = client.load().spec_decode  # since start: the first test request's too
    assert counts.num_drafts >= summary["speculative"]["num_drafts"]
    with running_gateway(speculating_server.address, unused_tcp_port) as url:
        result = bench(
            "serve", "--backend", "openai", "--url", url, "--vocab-size", "49152", *load,
            "--output-json", str(out),
        )  # fmt: skip
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            exposition = response.read().decode()
    assert result.returncode == 0, result.stderr
    _assert_acceptance(json.loads(out.read_text())["speculative"])
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert re.search(
            rf'^vllm:spec_decode_{name}_total{{model_name="[^"]+"}} [1-9]', exposition, re.M
        )
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=" in exposition


def test_serve_reports_no_acceptance_for_a_server_that_does_not_speculate(server, tmp_path):
    out = tmp_path / "result.json"
    result = bench("serve", "--url", server.address, "--num-prompts", "2", "--output-len", "4",
                   "--output-json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "speculative" not in json.loads(out.read_text())
    assert "Draft acceptance" not in result.stdout


def test_throughput_with_speculation_against_none_on_a_dataset(tiny_llama_dir, tmp_path):
    out, dataset = tmp_path / "result.json", tmp_path / "prompts.json"
    turns = ["Repeat: one two three one two three one two three", "Say a b a b a b a b"]
    dataset.write_text(
        json.dumps([{"conversations": [{"from": "human", "value": t}]} for t in turns])
    )
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    result = bench(
        "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32", "--num-prompts", "2",
        "--output-len", "40", "--kv-cache-memory", "0.05", "--dataset", str(dataset),
        "--speculative-config", spec, "--baseline", "free", "--output-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "engine / free output throughput:" in result.stdout
    assert "draft tokens accepted" in result.stdout
    results = json.loads(out.read_text())
    assert results["engine"]["output_tokens"] == results["free"]["output_tokens"] > 2
    spec = results["speculative"]
    assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    bad = bench("throughput", "--speculative-config", '{"method": "medusa"}')
    assert (
        bad.returncode == common.EXIT_USAGE and "method 'medusa' needs Medusa heads" in bad.stderr
    )


def test_acceptance_from_a_metrics_exposition_and_in_the_table():
    exposition = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 10.0',
        'vllm:spec_decode_num_drafts_total{model_name="m",engine="1"} 6.0',
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 48.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 20.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 12.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 8.0',
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="m"} 1.0',
    ])  # fmt: skip
    counts = spec_counts_of_metrics(exposition)
    assert counts == SpecDecode(16, 48, 20, (12, 8))
    assert spec_counts_of_metrics('vllm:num_requests_running{model_name="m"} 1.0\n') is None
    run = counts - SpecDecode(6, 18, 5, (5,))
    assert run == SpecDecode(10, 30, 15, (7, 8))
    spec = metrics.acceptance(run)
    assert (spec["acceptance_rate"], spec["mean_accepted_length"]) == (0.5, 2.5)
    ok = RequestResult(success=True, prompt_len=4, output_len=2, ttft=0.1, itl=[0.1], latency=0.2)
    summary = metrics.summarize([ok], duration_s=1.0, config={"backend": "grpc"} | _CONFIG)
    assert "Draft acceptance" not in metrics.format_table(summary)
    summary["speculative"] = spec
    assert re.search(r"Draft acceptance rate +50\.0%", metrics.format_table(summary))
    summary["speculative"] = metrics.acceptance(SpecDecode(0, 0, 0, ()))
    assert re.search(r"Draft acceptance rate +no drafts proposed", metrics.format_table(summary))


_CONFIG = {"concurrency": 1, "request_rate": "inf"}
