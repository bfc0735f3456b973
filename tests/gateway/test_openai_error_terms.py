"""What a REST caller reads in an error is in OpenAI's terms: a 400 names the OpenAI parameter in
``param`` and in its message, never a gRPC field path (``text``, ``stopping.max_tokens``,
``chat.messages``); the statuses FastAPI and Starlette answer themselves (unknown route, wrong
method) carry an OpenAI client error type, not ``server_error``."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest
from gateway_support import post, sse_data

from llmrpc.clients import ErrorDetails, FieldViolation, LlmrpcError
from llmrpc.gateway.errors import OpenAIError, from_grpc
from llmrpc.gateway.param_names import CHAT_PARAMS

MESSAGES = [{"role": "user", "content": "Hi"}]
LONG_TEXT = "word " * 2000  # beyond the tiny model's context
# gRPC request field paths a REST caller never wrote.
GRPC_PATH = re.compile(
    r"\b(?:sampling|stopping|output|chat)\.|(?<![a-z_])token_ids|^text\b|^input\b"
)

COMPLETIONS = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 7}, "top_p"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "x", "min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop[1]"),
    ({"prompt": "x", "bad_words": ["a", ""]}, "bad_words[1]"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": [99999999]}, "prompt"),
    ({"prompt": LONG_TEXT}, "prompt"),
    ({"prompt": ""}, "prompt"),
]
CHAT = [
    ({"messages": MESSAGES, "max_completion_tokens": 100000}, "max_completion_tokens"),
    ({"messages": MESSAGES, "max_tokens": 100000}, "max_tokens"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": MESSAGES, "prompt_logprobs": 99}, "prompt_logprobs"),
    ({"messages": MESSAGES, "stop": ["", "x"]}, "stop[0]"),
    ({"messages": MESSAGES, "top_k": -5}, "top_k"),
    ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages"),
    (
        {"messages": MESSAGES, "max_completion_tokens": 4, "min_tokens": 8},
        "min_tokens",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    (
        {"messages": MESSAGES, "skip_special_tokens": False, "prompt_logprobs": -3},
        "prompt_logprobs",
    ),
]
TOKENIZE = [
    ({"prompt": [99999999]}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"messages": [{"role": "user"}], "add_generation_prompt": "x"}, "add_generation_prompt"),
]


def assert_in_openai_terms(error: dict, param: str) -> None:
    assert error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error
    assert not GRPC_PATH.search(error["message"]), error


@pytest.mark.parametrize(("body", "param"), COMPLETIONS, ids=[p for _, p in COMPLETIONS])
def test_completion_400s_name_the_openai_parameter(gateway, body, param):
    reply = post(gateway, "/v1/completions", body)
    assert reply.status_code == 400, reply.text
    assert_in_openai_terms(reply.json()["error"], param)


@pytest.mark.parametrize(("body", "param"), CHAT, ids=[p for _, p in CHAT])
def test_chat_400s_name_the_openai_parameter(gateway, body, param):
    reply = post(gateway, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    assert_in_openai_terms(reply.json()["error"], param)


@pytest.mark.parametrize(("body", "param"), TOKENIZE, ids=[p for _, p in TOKENIZE])
def test_tokenize_400s_name_the_parameter_of_the_form_sent(gateway, body, param):
    """/tokenize takes a prompt or messages: an error is about the form the caller sent."""
    reply = post(gateway, "/tokenize", body)
    assert reply.status_code == 400, reply.text
    assert_in_openai_terms(reply.json()["error"], param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, "stop[1]"),
        ("/v1/completions", {"prompt": LONG_TEXT}, "prompt"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 100000}, "max_tokens"),
    ],
)
def test_streamed_requests_refused_before_the_first_chunk_too(gateway, path, body, param):
    reply = post(gateway, path, {**body, "stream": True})
    assert reply.status_code == 400, reply.text
    assert_in_openai_terms(reply.json()["error"], param)


def test_a_field_that_is_no_parameter_of_the_caller_is_not_named():
    details = ErrorDetails(field_violations=(FieldViolation("stopping.time_limit_ms", "too big"),))
    error = from_grpc(
        LlmrpcError(grpc.StatusCode.INVALID_ARGUMENT, "stopping.time_limit_ms: too big", details),
        CHAT_PARAMS,
    )
    assert (error.param, error.message) == (None, "too big")


def test_a_grpc_path_is_replaced_wherever_the_message_has_it():
    violation = FieldViolation("chat.messages[1].content", "must be text")
    error = from_grpc(
        LlmrpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat.messages[1].content: must be text",
            ErrorDetails(field_violations=(violation,)),
        ),
        CHAT_PARAMS,
    )
    assert (error.param, error.message) == (
        "messages[1].content",
        "messages[1].content: must be text",
    )


# --- statuses the framework answers itself ----------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/completions", "POST"),
        ("DELETE", "/v1/chat/completions", "POST"),
        ("PUT", "/health", "GET"),
    ],
)
def test_a_wrong_method_is_a_client_error_saying_which_are_allowed(gateway, method, path, allowed):
    reply = httpx.request(method, gateway.url + path, timeout=30)
    assert reply.status_code == 405
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert error["message"] == f"{method} {path}: method not allowed (allowed: {allowed})"
    assert allowed in reply.headers["allow"]


def test_an_unknown_route_is_not_found_naming_it(gateway):
    reply = httpx.post(gateway.url + "/v1/nothing-here", json={}, timeout=30)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["type"] == "not_found_error", error
    assert error["message"] == "POST /v1/nothing-here: no such route"


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (405, "invalid_request_error"),
        (406, "invalid_request_error"),
        (415, "invalid_request_error"),
        (422, "invalid_request_error"),
        (431, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (503, "server_error"),
    ],
)
def test_every_client_status_has_a_client_error_type(status, kind):
    assert OpenAIError(status, "m").body()["error"]["type"] == kind


def test_an_sse_error_event_uses_the_same_envelope():
    event = OpenAIError(400, "stop[1]: must not be empty", "stop[1]").sse_event()
    (data,) = sse_data(event + b"data: [DONE]\n\n")[:-1]
    assert json.loads(data)["error"]["param"] == "stop[1]"


def test_a_bound_names_the_length_parameter_the_caller_sent(gateway):
    body = {"messages": MESSAGES, "max_completion_tokens": 4, "min_tokens": 8}
    reply = post(gateway, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "max_completion_tokens" in message, message
    assert not re.search(r"(?<!_)max_tokens", message), message
