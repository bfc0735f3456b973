"""A fault inside the engine that belongs to one request is an OpenAI 500 envelope (or, once its
stream has begun, an SSE error event) naming the request id; the server goes on serving."""

from __future__ import annotations

import json

import engine_hooks
import pytest
from engine_pace import in_core
from gateway_support import post, sse_data


@pytest.fixture
def faulty_detokenizer(replica):
    """The engine's detokenization raises for requests whose id starts with "bad-" (a generated
    id, 32 hex digits, never does; one starting "bad" once failed the request meant to succeed),
    after their first eight tokens, so the stream has begun (after two, a clean-clone run once
    saw the fault before the first event: a 500 instead of an SSE error)."""
    engine = replica.running.engine
    in_core(engine, engine_hooks.fail_requests, "output_processor.add_token", "bad-", "unicode", 8)
    yield
    in_core(engine, engine_hooks.remove_faults)


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
