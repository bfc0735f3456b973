"""A fault inside the engine that belongs to one request is an OpenAI 500 envelope (or, once its
stream has begun, an SSE error event) naming the request id; the server goes on serving."""

from __future__ import annotations

import json

import pytest
from gateway_support import post, sse_data


@pytest.fixture
def faulty_detokenizer(replica, monkeypatch):
    """The engine's detokenization raises for requests whose id starts with "bad"."""
    processor = replica.running.engine.core.output_processor
    real = processor.add_token
    calls = {"bad": 0}

    def add_token(req, *args):
        if req.request_id.startswith("bad"):
            calls["bad"] += 1
            if calls["bad"] > 2:  # after two tokens: the stream has begun
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(req, *args)

    monkeypatch.setattr(processor, "add_token", add_token)
    return calls


BODY = {"prompt": "A request among others", "max_tokens": 16, "ignore_eos": True}


def test_unary_fault_is_a_500_envelope_with_the_request_id(gateway, faulty_detokenizer):
    reply = post(gateway, "/v1/completions", BODY, headers={"x-request-id": "bad-rest-1"})
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert "bad-rest-1" in error["message"] and "injected" in error["message"]
    assert post(gateway, "/v1/completions", BODY).json()["usage"]["completion_tokens"] == 16


def test_streamed_fault_is_an_sse_error_event(gateway, faulty_detokenizer):
    body = {**BODY, "stream": True}
    reply = post(gateway, "/v1/completions", body, headers={"x-request-id": "bad-rest-2"})
    assert reply.status_code == 200
    events = sse_data(reply.content)
    error = json.loads(events[-2])["error"]
    assert "bad-rest-2" in error["message"] and error["code"] == "internal"
    assert post(gateway, "/v1/completions", BODY).json()["usage"]["completion_tokens"] == 16
