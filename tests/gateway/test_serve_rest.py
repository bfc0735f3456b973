"""``llmrpc serve`` runs the REST gateway on --host/--port in front of its own gRPC server: the
serve flags reach it, TLS, mutual TLS and API keys hold on both, and SIGTERM stops both."""

from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from envoy_support import TestCa

from llmrpc import cli
from llmrpc.server import options

PARSER = cli.build_parser()[1]
START_TIMEOUT_S = 120.0


def _configs(*argv: str):
    return options.build_configs(options.parse_serve_values(PARSER, list(argv)))


def test_rest_flags_reach_the_gateway_configuration():
    _, frontend = _configs(
        "--port", "9001", "--uds", "/tmp/x.sock", "--root-path", "/llm",
        "--allowed-origins", '["https://a.example"]', "--allow-credentials",
        "--middleware", "a.b", "c.d", "--disable-fastapi-docs", "--enable-request-id-headers",
        "--h11-max-header-count", "64", "--response-role", "bot",
        "--chat-template-content-format", "openai", "--return-tokens-as-token-ids",
        "--enable-prompt-tokens-details", "--enable-force-include-usage",
        "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
    )  # fmt: skip
    http, cors, api = frontend.rest_http, frontend.rest_cors, frontend.rest_api
    assert (http.port, http.uds, http.root_path) == (9001, "/tmp/x.sock", "/llm")
    assert cors.allowed_origins == ("https://a.example",) and cors.allow_credentials
    assert api.middleware == ("a.b", "c.d") and http.h11_max_header_count == 64
    assert api.response_role == "bot" and api.chat_template_content_format == "openai"
    assert http.uvicorn_log_level == "warning" and http.disable_uvicorn_access_log
    for name in (
        "disable_fastapi_docs", "enable_request_id_headers", "return_tokens_as_token_ids",
        "enable_prompt_tokens_details", "enable_force_include_usage",
        "enable_server_load_tracking", "enable_tokenizer_info_endpoint",
    ):  # fmt: skip
        assert getattr(api, name) is True, name
    assert frontend.rest_gateway and not _configs("--no-rest-gateway")[1].rest_gateway


class Serve:
    """``llmrpc serve`` in a subprocess, its log read on a thread."""

    def __init__(self, *args: str) -> None:
        path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
        command = [sys.executable, "-m", "llmrpc.cli", "serve", *args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.process.poll() is None:
            for line in list(self.log):
                if match := re.search(pattern, line):
                    return match
            time.sleep(0.05)
        pytest.fail(f"no log line matching {pattern!r}:\n{''.join(self.log)[-3000:]}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


def _tiny_serve_args(model_dir: Path) -> list[str]:
    return [str(model_dir), "--host", "127.0.0.1", "--grpc-port", "0", "--dtype", "float32"]


def test_serve_runs_the_gateway_with_mtls_and_api_keys(tiny_llama_dir, tmp_path):
    ca = TestCa(tmp_path)
    cert, key = ca.issue("server", ("localhost",))
    client_cert = ca.issue("client")
    serve = Serve(
        *_tiny_serve_args(tiny_llama_dir), "--port", "0", "--api-key", "k",
        "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
        "--ssl-ca-certs", str(ca.cert), "--ssl-cert-reqs", "2",
        "--enable-request-id-headers", "--response-role", "bot",
        "--middleware", "sample_middleware.TagResponses", "--disable-uvicorn-access-log",
    )  # fmt: skip
    try:
        port = int(serve.wait_for(r"REST gateway \(https\) listening on port (\d+)").group(1))
        serve.wait_for(r"serving .* on gRPC port")
        context = ssl.create_default_context(cafile=str(ca.cert))
        context.load_cert_chain(*client_cert)
        http = httpx.Client(verify=context, timeout=60)
        sdk = openai.OpenAI(
            base_url=f"https://localhost:{port}/v1", api_key="k", http_client=http, max_retries=0
        )
        chat = sdk.chat.completions.with_raw_response.create(
            model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert chat.parse().choices[0].message.role == "bot"
        assert chat.headers["x-request-id"] and chat.headers["x-tagged-by"] == "class"
        with pytest.raises(openai.AuthenticationError):
            sdk.with_options(api_key="wrong").models.list()
        anonymous = ssl.create_default_context(cafile=str(ca.cert))  # no client certificate
        with pytest.raises((httpx.TransportError, ssl.SSLError)):
            httpx.get(f"https://localhost:{port}/health", verify=anonymous).raise_for_status()
        http.close()
        assert serve.stop() == 0
    finally:
        serve.kill()


def test_serve_stops_at_once_when_the_rest_port_is_taken(tiny_llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = Serve(*_tiny_serve_args(tiny_llama_dir), "--port", str(port))
        try:
            assert serve.process.wait(timeout=120) == 1
        finally:
            serve.kill()
    assert any(f"--port {port}" in line for line in serve.log), "".join(serve.log)


def test_rest_serves_during_the_drain_delay_and_its_stream_in_flight_finishes(tiny_llama_dir):
    """As gRPC does: after SIGTERM with --drain-delay, /health says 503 (NOT_SERVING) while new
    calls are still served; the stream begun before SIGTERM finishes; the process exits 0."""
    serve = Serve(
        *_tiny_serve_args(tiny_llama_dir), "--port", "0",
        "--drain-delay", "3", "--shutdown-grace", "30",
    )  # fmt: skip
    try:
        port = int(serve.wait_for(r"REST gateway \(http\) listening on port (\d+)").group(1))
        serve.wait_for(r"serving .* on gRPC port")
        body = {"prompt": "Hello", "max_tokens": 64, "ignore_eos": True, "stream": True}
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        with http, http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            serve.process.send_signal(signal.SIGTERM)
            serve.wait_for(r"draining for")
            during = http.post("/v1/chat/completions", json=chat)
            health = http.get("/health").status_code
            rest = [line for line in lines if line]
        assert during.status_code == 200, during.text
        assert during.json()["choices"][0]["message"]["content"] is not None
        assert health == 503  # as gRPC health: NOT_SERVING while draining
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2].replace(" ", "")
        assert serve.process.wait(timeout=60) == 0
    finally:
        serve.kill()
