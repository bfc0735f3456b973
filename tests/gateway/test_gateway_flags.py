"""Each REST flag of ``llmrpc gateway`` / ``llmrpc serve`` doing what it says, on gateways in
front of one replica of the tiny model."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time

import httpx
import openai
import pytest
from envoy_support import TestCa
from gateway_support import post, running_gateway, sse_json

from llmrpc.gateway.app import create_app
from llmrpc.gateway.connections import ConnectionBudget
from llmrpc.gateway.server import BindError, bind_socket
from llmrpc.gateway.settings import ApiSettings, HttpSettings

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hi"}]
SHORT = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
BUDGET = ConnectionBudget(max_connections=16, header_timeout_s=10.0)  # for bare listeners


@pytest.fixture(scope="module")
def start(server_loop, replica):
    """``start(api={...}, http={...}, cors={...})``: a gateway with those settings."""

    def start(**sections):
        return running_gateway(server_loop, [replica.address], **sections)

    return start


def test_cors_origins_methods_and_credentials(start):
    cors = {
        "allowed_origins": ("https://app.example",),
        "allowed_methods": ("POST",),
        "allow_credentials": True,
    }
    with start(cors=cors) as gateway:
        url = gateway.url + "/v1/completions"
        asked = {"origin": "https://app.example", "access-control-request-method": "POST"}
        allowed = httpx.options(url, headers=asked)
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert allowed.headers["access-control-allow-credentials"] == "true"
        assert (
            httpx.options(url, headers={**asked, "origin": "https://evil.example"}).status_code
            == 400
        )
        assert (
            httpx.options(
                url, headers={**asked, "access-control-request-method": "DELETE"}
            ).status_code
            == 400
        )
    with start() as gateway:  # the defaults: every origin
        reply = httpx.get(gateway.url + "/health", headers={"origin": "https://any.example"})
        assert reply.headers["access-control-allow-origin"] == "*"


def test_api_key_is_required_on_rest_but_not_for_probes(start):
    with start(api={"api_keys": ("key-1", "key-2")}) as gateway:
        assert post(gateway, "/v1/completions", SHORT).status_code == 401
        wrong = post(gateway, "/v1/completions", SHORT, headers={"authorization": "Bearer no"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
        right = post(gateway, "/v1/completions", SHORT, headers={"authorization": "Bearer key-2"})
        assert right.status_code == 200
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(gateway.url + path).status_code == 200, path
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gateway.url + "/v1", api_key="no", max_retries=0).models.list()
        sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="key-1", max_retries=0)
        assert sdk.models.list().data


def test_root_path_for_a_prefix_stripping_proxy(start):
    with start(http={"root_path": "/llm"}) as gateway:
        # The proxy took /llm off: the gateway serves the paths without it...
        sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        assert sdk.completions.create(model="", prompt=PROMPT, max_tokens=2).choices[0].text
        # ...and the URLs it hands out carry it.
        assert httpx.get(gateway.url + "/openapi.json").json()["servers"] == [{"url": "/llm"}]
        assert "/llm/openapi.json" in httpx.get(gateway.url + "/docs").text


def test_middleware_classes_and_functions_are_added(start):
    paths = ("sample_middleware.TagResponses", "sample_middleware.tag_with_function")
    with start(api={"middleware": paths}) as gateway:
        reply = post(gateway, "/v1/completions", SHORT)
        assert reply.headers["x-tagged-by"] == "class"
        assert reply.headers["x-tagged-by-function"] == "yes"
    for bad in ("sample_middleware.NOT_MIDDLEWARE", "sample_middleware.missing", "nodots"):
        with pytest.raises(ValueError, match="--middleware"):
            create_app(_settings_with(middleware=(bad,)))


def _settings_with(**api):
    from gateway_support import gateway_settings

    return gateway_settings(["127.0.0.1:1"], api=api)


def test_disable_fastapi_docs(start):
    with start() as gateway:
        assert httpx.get(gateway.url + "/docs").status_code == 200
    with start(api={"disable_fastapi_docs": True}) as gateway:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(gateway.url + path).status_code == 404, path


def test_request_id_headers(start):
    with start() as gateway:
        assert "x-request-id" not in post(gateway, "/v1/completions", SHORT).headers
    with start(api={"enable_request_id_headers": True}) as gateway:
        mine = post(gateway, "/v1/completions", SHORT, headers={"x-request-id": "mine-1"})
        assert mine.headers["x-request-id"] == "mine-1"
        assert mine.json()["id"] == "cmpl-mine-1"  # and the gRPC request's id
        made = post(gateway, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        assert made.json()["id"] == "chatcmpl-" + made.headers["x-request-id"]


def _reply_to_raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        return sock.recv(200)


def test_h11_limits(start):
    http = {"h11_max_incomplete_event_size": 2048, "h11_max_header_count": 20}
    with start(http=http) as gateway:
        port = gateway.server.port
        head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: "
        assert _reply_to_raw(port, head + b"a" * 1000 + b"\r\n\r\n").startswith(b"HTTP/1.1 200")
        # A request head still unfinished past the limit is refused without waiting for more.
        assert _reply_to_raw(port, head + b"a" * 4000).startswith(b"HTTP/1.1 400")
        url = gateway.url + "/health"
        assert httpx.get(url, headers={f"x-h{i}": "1" for i in range(10)}).status_code == 200
        assert httpx.get(url, headers={f"x-h{i}": "1" for i in range(30)}).status_code == 431


def test_uvicorn_log_level_and_access_log(start):
    with start(http={"uvicorn_log_level": "error"}):
        assert logging.getLogger("uvicorn.error").getEffectiveLevel() == logging.ERROR
        assert logging.getLogger("uvicorn.access").hasHandlers()
    with start(http={"uvicorn_log_level": "debug", "disable_uvicorn_access_log": True}):
        assert logging.getLogger("uvicorn.error").getEffectiveLevel() == logging.DEBUG
        assert not logging.getLogger("uvicorn.access").hasHandlers()


def test_uds_serves_on_a_unix_socket(start, tmp_path):
    path = str(tmp_path / "gateway.sock")
    with start(http={"uds": path}):
        transport = httpx.HTTPTransport(uds=path)
        with httpx.Client(transport=transport, base_url="http://gateway") as client:
            assert client.post("/v1/completions", json=SHORT).json()["choices"][0]["text"]


def _health_over_tls(port: int, ca: TestCa, client=None) -> tuple[bytes, bytes]:
    """The first bytes of the answer to GET /health, and the server's certificate (DER)."""
    context = ssl.create_default_context(cafile=str(ca.cert))
    if client is not None:
        context.load_cert_chain(*client)
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    with raw, context.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        return tls.recv(100), tls.getpeercert(binary_form=True)


def _served_certificate(port: int, ca: TestCa) -> bytes:
    reply, certificate = _health_over_tls(port, ca)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    return certificate


def test_tls_and_mutual_tls(start, tmp_path):
    ca = TestCa(tmp_path)
    cert, key = ca.issue("gateway", ("localhost",))
    tls = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    with start(http=tls) as gateway:
        port = gateway.server.port
        context = ssl.create_default_context(cafile=str(ca.cert))
        reply = httpx.post(f"https://localhost:{port}/v1/completions", json=SHORT, verify=context)
        assert reply.status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health")  # plaintext is not served
    mtls = {**tls, "ssl_ca_certs": str(ca.cert), "ssl_cert_reqs": 2}
    with start(http=mtls) as gateway:
        port = gateway.server.port
        try:
            refused, _ = _health_over_tls(port, ca)
        except (ssl.SSLError, ConnectionError, ValueError):  # ValueError: no certificate
            refused = b""
        assert refused == b""  # TLS 1.3: the server drops the connection after the handshake
        answered, _ = _health_over_tls(port, ca, ca.issue("client"))
        assert answered.startswith(b"HTTP/1.1 200")


def test_ssl_refresh_serves_replaced_certificates(start, tmp_path):
    ca = TestCa(tmp_path)
    cert, key = ca.issue("gateway", ("localhost",))
    http = {"ssl_certfile": str(cert), "ssl_keyfile": str(key), "enable_ssl_refresh": True}
    with start(http=http) as gateway:
        first = _served_certificate(gateway.server.port, ca)
        time.sleep(0.05)
        ca.issue("gateway", ("localhost",))  # new files at the same paths
        deadline = time.monotonic() + 15
        while _served_certificate(gateway.server.port, ca) == first:
            assert time.monotonic() < deadline, "the new certificate was never served"
            time.sleep(0.2)


def test_prompt_tokens_details_report_cached_tokens(start):
    long_prompt = PROMPT + " and" * 60  # several KV blocks: the second time they are cached
    body = {**SHORT, "prompt": long_prompt}
    with start() as gateway:
        assert "prompt_tokens_details" not in post(gateway, "/v1/completions", body).json()["usage"]
    with start(api={"enable_prompt_tokens_details": True}) as gateway:
        post(gateway, "/v1/completions", body)
        usage = post(gateway, "/v1/completions", body).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 32


def test_force_include_usage_ends_every_stream_with_usage(start):
    with start(api={"enable_force_include_usage": True}) as gateway:
        for path, body in (
            ("/v1/completions", {**SHORT, "stream": True}),
            ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "stream": True}),
        ):
            events = sse_json(post(gateway, path, body).content)
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
            assert all(e["usage"] is None for e in events[:-1])


def test_return_tokens_as_token_ids(start):
    with start(api={"return_tokens_as_token_ids": True}) as gateway:
        completion = post(gateway, "/v1/completions", {**SHORT, "logprobs": 1}).json()
        tokens = completion["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 3 and all(t.startswith("token_id:") for t in tokens)
        chat = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
        content = post(gateway, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]
        assert all(e["token"].startswith("token_id:") for e in content["content"])
        assert int(content["content"][0]["token"].split(":")[1]) >= 0


def test_response_role(start):
    with start(api={"response_role": "bot"}) as gateway:
        body = {"messages": MESSAGES, "max_tokens": 2}
        assert (
            post(gateway, "/v1/chat/completions", body).json()["choices"][0]["message"]["role"]
            == "bot"
        )
        events = sse_json(post(gateway, "/v1/chat/completions", {**body, "stream": True}).content)
        assert events[0]["choices"][0]["delta"]["role"] == "bot"
        continued = [*MESSAGES, {"role": "assistant", "content": "Hello"}]
        body = {"messages": continued, "max_tokens": 2, "add_generation_prompt": False}
        reply = post(gateway, "/v1/chat/completions", body).json()
        assert reply["choices"][0]["message"]["role"] == "assistant"  # the last message's


def test_tokenizer_info_endpoint(start):
    with start() as gateway:
        assert httpx.get(gateway.url + "/get_tokenizer_info").status_code == 404
    with start(api={"enable_tokenizer_info_endpoint": True}) as gateway:
        info = httpx.get(gateway.url + "/get_tokenizer_info").json()
        assert info["vocab_size"] > 1000 and info["has_chat_template"] is True


def test_server_load_tracking(start, slow_engine):
    with start() as gateway:
        assert httpx.get(gateway.url + "/load").status_code == 404
    with start(api={"enable_server_load_tracking": True}) as gateway:
        assert httpx.get(gateway.url + "/load").json() == {"server_load": 0}
        body = {**SHORT, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body) as reply:
            lines = reply.iter_lines()  # held: dropping it would close the connection
            assert next(lines).startswith("data: ")
            assert httpx.get(gateway.url + "/load").json() == {"server_load": 1}
        deadline = time.monotonic() + 10
        while httpx.get(gateway.url + "/load").json()["server_load"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_api_settings_check_their_values():
    with pytest.raises(ValueError, match="--chat-template-content-format"):
        ApiSettings(chat_template_content_format="xml")
    with pytest.raises(ValueError, match="--api-key"):
        ApiSettings(api_keys=("",))


def test_uds_in_use_by_a_live_server_is_refused_and_kept(tmp_path):
    """A socket file a live process listens on is not taken over (its listener would be cut
    off); one left by a dead process is replaced."""
    path = str(tmp_path / "live.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen()
    with live:
        with pytest.raises(BindError, match=r"^--uds .*live\.sock: .*in use"):
            bind_socket(HttpSettings(uds=path), BUDGET)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)  # the live listener still has its file

    stale = str(tmp_path / "stale.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(stale)
    dead.close()  # the file stays, nobody listens
    bind_socket(HttpSettings(uds=stale), BUDGET).close()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", None])
async def test_accepted_connections_send_without_nagle_delay(host):
    """asyncio turns Nagle's algorithm off only on sockets made with proto IPPROTO_TCP; with it on,
    an SSE chunk written after the headers waited for the client's delayed ACK (about 40 ms were
    added to the first token over REST)."""
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    listener = bind_socket(HttpSettings(host=host, port=0), BUDGET)
    seen = asyncio.get_running_loop().create_future()

    async def accepted(reader, writer):
        sock = writer.get_extra_info("socket")
        seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=listener)
    async with server:
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("::1" if host == "::1" else "127.0.0.1", port)
        assert await asyncio.wait_for(seen, 10) != 0
        writer.close()
