"""Errors in OpenAI's envelope with the HTTP status of the gRPC status, errors after a stream
began as SSE error events, and a client that disconnects aborting its request in the engine."""

from __future__ import annotations

import socket
import time

import grpc
import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from gateway_support import RunningGateway, gateway_settings, post, sse_data

from llmrpc.clients import ErrorDetails, FieldViolation, LlmrpcError
from llmrpc.gateway.errors import from_grpc, install_handlers
from llmrpc.gateway.sse import first_then_rest

MESSAGES = [{"role": "user", "content": "Hi"}]


def _error(reply: httpx.Response, status: int, param: str | None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),  # the gateway's
        ("/v1/completions", {"prompt": "x", "top_p": 7}, "top_p"),  # the replica's
        ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 99},
         "top_logprobs"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}},
         "response_format.type"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]},
         "tools[0].function"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].type"),
        ("/v1/chat/completions",
         {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
         "continue_final_message"),
    ],
)  # fmt: skip
def test_bad_requests_get_400_naming_the_parameter(gateway, path, body, param):
    error = _error(post(gateway, path, body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_is_a_400(gateway):
    reply = httpx.post(gateway.url + "/v1/completions", content=b"{not json", timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_a_404_and_unknown_path_too(gateway):
    error = _error(post(gateway, "/v1/completions", {"prompt": "x", "model": "no"}), 404, "model")
    assert error["type"] == "not_found_error" and error["code"] == "model_not_found"
    assert httpx.get(gateway.url + "/v1/nothing-here").json()["error"]["type"] == "not_found_error"


def test_the_sdk_raises_with_the_parameter(gateway):
    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model="", prompt="x", top_p=7)
    assert caught.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as caught:  # refused before the stream starts
        list(sdk.chat.completions.create(model="", messages=MESSAGES, top_p=7, stream=True))
    assert caught.value.param == "top_p"


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ],
)
def test_grpc_statuses_map_to_http_statuses(code, status):
    details = ErrorDetails(field_violations=(FieldViolation("stopping.max_tokens", "too big"),))
    error = from_grpc(LlmrpcError(code, "failed", details))
    assert error.status == status and error.param == "max_tokens"
    assert error.body()["error"]["code"] == code.name.lower()


def test_retry_info_becomes_retry_after():
    details = ErrorDetails(retry_delay=1.2)
    error = from_grpc(LlmrpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", details))
    assert error.response().headers["retry-after"] == "2"


def _stream_app(fail_after: int) -> FastAPI:
    async def chunks():
        for i in range(fail_after):
            yield f"data: {i}\n\n".encode()
        raise LlmrpcError(grpc.StatusCode.UNAVAILABLE, "the replica went away")

    app = FastAPI()
    install_handlers(app)

    @app.get("/stream")
    async def stream(request: Request):
        return await first_then_rest(request, chunks())

    return app


async def test_an_error_after_the_stream_began_is_an_sse_error_event():
    transport = httpx.ASGITransport(app=_stream_app(fail_after=2))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        reply = await client.get("/stream")
        assert reply.status_code == 200
        data = sse_data(reply.content)
        assert data[:2] == ["0", "1"] and data[-1] == "[DONE]"
        assert '"error":' in data[2] and "the replica went away" in data[2]


async def test_an_error_before_the_first_chunk_gets_its_http_status():
    transport = httpx.ASGITransport(app=_stream_app(fail_after=0))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        reply = await client.get("/stream")
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"


def test_a_replica_not_serving_still_answers_while_no_other_serves(gateway, replica):
    """/health follows gRPC health (503 while the replica says NOT_SERVING: loading, draining);
    with no other replica serving, calls still go to it and it answers for itself (a draining
    one serves them, as it does gRPC calls)."""
    replica.set_serving(False)
    try:
        deadline = time.monotonic() + 10
        while gateway.state.pool.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert httpx.get(gateway.url + "/health").status_code == 503
        reply = post(gateway, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert reply.status_code == 200, reply.text
    finally:
        replica.set_serving(True)
    deadline = time.monotonic() + 10
    while not gateway.state.pool.serving and time.monotonic() < deadline:
        time.sleep(0.01)
    assert httpx.get(gateway.url + "/health").status_code == 200


def test_no_reachable_replica_is_a_503(server_loop):
    unreachable = "127.0.0.1:1"  # nothing listens there
    gateway = RunningGateway(server_loop, gateway_settings([unreachable]))
    try:
        assert httpx.get(gateway.url + "/health").status_code == 503
        error = _error(post(gateway, "/v1/completions", {"prompt": "x"}), 503, None)
        assert error["message"] == f"no gRPC replica is serving ({unreachable})", error
    finally:
        gateway.stop()


# --- disconnects ------------------------------------------------------------------------------


def _live(engine) -> int:
    stats = engine.stats
    return stats.num_running + stats.num_waiting


def _wait(condition, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


LONG = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}


def test_disconnecting_from_a_stream_aborts_the_request(gateway, slow_engine):
    body = {**LONG, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: {")
        assert _live(slow_engine) == 1
    _wait(lambda: _live(slow_engine) == 0, "the engine to drop the abandoned stream")


def test_disconnecting_before_the_answer_aborts_the_request(gateway, slow_engine):
    host, port = "127.0.0.1", gateway.server.port
    payload = httpx.Request("POST", gateway.url + "/v1/completions", json=LONG)
    head = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
    raw = f"{head}content-length: {len(payload.read())}\r\n\r\n".encode() + payload.read()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(raw)
        _wait(lambda: _live(slow_engine) == 1, "the request to reach the engine")
    _wait(lambda: _live(slow_engine) == 0, "the engine to drop the abandoned request")
