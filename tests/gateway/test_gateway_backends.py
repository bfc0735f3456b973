"""``llmrpc gateway`` in front of several replicas: requests spread over the serving ones, a
NOT_SERVING or unreachable one gets none; the command line itself; Prometheus metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from envoy_support import tiny_engine_config
from gateway_support import post, running_gateway, sse_json
from prometheus_client.parser import text_string_to_metric_families

SHORT = {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def second_replica(server_loop, tiny_llama_dir: Path):
    started = server_loop.start_replica(tiny_engine_config(tiny_llama_dir), port=0)
    yield started
    started.stop()


def _wait(condition, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_requests_spread_over_serving_replicas_only(server_loop, replica, second_replica):
    replicas = [replica, second_replica]
    unreachable = "127.0.0.1:1"  # nothing listens there: never serving
    with running_gateway(server_loop, [r.address for r in replicas] + [unreachable]) as gateway:
        _wait(lambda: len(gateway.state.pool.serving) == 2, "both replicas serving")
        before = [r.num_calls for r in replicas]
        for _ in range(10):
            assert post(gateway, "/v1/completions", SHORT).status_code == 200
        served = [r.num_calls - b for r, b in zip(replicas, before, strict=True)]
        assert sum(served) >= 10 and all(s >= 3 for s in served), served

        second_replica.set_serving(False)
        try:
            _wait(lambda: len(gateway.state.pool.serving) == 1, "the gateway to see NOT_SERVING")
            before = [r.num_calls for r in replicas]
            for _ in range(6):
                assert post(gateway, "/v1/completions", SHORT).status_code == 200
            assert second_replica.num_calls == before[1]
            assert replica.num_calls - before[0] >= 6
        finally:
            second_replica.set_serving(True)
        _wait(lambda: len(gateway.state.pool.serving) == 2, "the replica back")


def _metrics(gateway) -> dict[str, float]:
    text = httpx.get(gateway.url + "/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels.get("le") and "finished_reason" not in sample.labels
    }


def test_metrics_use_vllms_names_and_count(server_loop, replica, slow_engine):
    with running_gateway(server_loop, [replica.address]) as gateway:
        post(gateway, "/v1/completions", SHORT)  # the model name label is known from here on
        before = _metrics(gateway)
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count",
        ):
            assert name in before, name
        body = {**SHORT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        usage = sse_json(post(gateway, "/v1/completions", body).content)[-1]["usage"]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        chat_usage = post(gateway, "/v1/chat/completions", chat).json()["usage"]
        after = _metrics(gateway)
        generated = usage["completion_tokens"] + chat_usage["completion_tokens"]
        prompt = usage["prompt_tokens"] + chat_usage["prompt_tokens"]
        assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == (
            generated
        )
        assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == prompt
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
            assert after[f"vllm:{name}_count"] - before[f"vllm:{name}_count"] == 2
        with httpx.stream(
            "POST", gateway.url + "/v1/completions", json={**body, "max_tokens": 300}
        ) as reply:
            lines = reply.iter_lines()
            next(lines)
            live = _metrics(gateway)
        assert live["vllm:num_requests_running"] == 1
        assert 0 < live["vllm:kv_cache_usage_perc"] <= 1
        # the replica's KV cache, on the CPU: no device memory, no utilization series
        kv_cache_bytes = slow_engine.stats.kv_cache_bytes
        assert live["llmrpc:kv_cache_bytes"] == kv_cache_bytes > 0
        assert live["llmrpc:device_memory_total_bytes"] == 0
        assert "llmrpc:device_utilization" not in live


def _gateway_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmrpc.cli", "gateway", *args]


def test_the_gateway_command(replica, tmp_path):
    socket_path = str(tmp_path / "gw.sock")
    args = ["--backend", replica.address, "--uds", socket_path, "--api-key", "k"]
    process = subprocess.Popen(
        _gateway_command(*args, "--uvicorn-log-level", "warning"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        transport = httpx.HTTPTransport(uds=socket_path)
        with httpx.Client(transport=transport, base_url="http://gateway", timeout=30) as client:
            _wait(lambda: _healthy(client), "the gateway to answer", timeout=60)
            assert client.post("/v1/completions", json=SHORT).status_code == 401
            headers = {"authorization": "Bearer k"}
            reply = client.post("/v1/completions", json=SHORT, headers=headers)
            assert reply.status_code == 200, reply.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        process.wait()


def _healthy(client: httpx.Client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def test_bad_flags_stop_the_command_with_one_line():
    done = subprocess.run(
        _gateway_command("--backend", "x:1", "--ssl-cert-reqs", "2", "--ssl-certfile", "c"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("llmrpc gateway: error: --ssl")


def test_gateway_flags_reach_its_settings(tmp_path):
    from llmrpc.gateway import cli

    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = cli.build_parser().parse_args(
        [
            "--backend", "a:1", "--backend", "b:2", "--backend-ca-certs", "ca.pem",
            "--api-key", "k1", "k2", "--port", "9000", "--root-path", "/llm",
            "--allowed-origins", '["https://a.example"]', "--allow-credentials",
            "--ssl-certfile", "c.pem", "--ssl-keyfile", "c.key", "--enable-ssl-refresh",
            "--chat-template", str(template), "--chat-template-content-format", "string",
            "--response-role", "bot", "--return-tokens-as-token-ids",
            "--enable-prompt-tokens-details", "--enable-force-include-usage",
            "--enable-tokenizer-info-endpoint", "--enable-server-load-tracking",
            "--enable-request-id-headers", "--disable-fastapi-docs",
            "--middleware", "a.b", "--middleware", "c.d",
        ]
    )  # fmt: skip
    settings = cli.settings_from_args(args)
    assert settings.backends.targets == ("a:1", "b:2") and settings.backends.api_key == "k1"
    assert settings.backends.ca_certs == "ca.pem"
    http = settings.http
    assert (http.port, http.root_path, http.ssl_certfile, http.enable_ssl_refresh) == (
        9000, "/llm", "c.pem", True,
    )  # fmt: skip
    assert settings.cors.allowed_origins == ("https://a.example",)
    assert settings.cors.allow_credentials
    api = settings.api
    assert api.api_keys == ("k1", "k2") and api.middleware == ("a.b", "c.d")
    assert api.chat_template == "{{ messages[0]['content'] }}"
    assert (api.chat_template_content_format, api.response_role) == ("string", "bot")
    for name in (
        "return_tokens_as_token_ids", "enable_prompt_tokens_details", "enable_force_include_usage",
        "enable_tokenizer_info_endpoint", "enable_server_load_tracking",
        "enable_request_id_headers", "disable_fastapi_docs",
    ):  # fmt: skip
        assert getattr(api, name) is True, name
