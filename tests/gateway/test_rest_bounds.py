"""Numbers the gRPC API cannot carry, lone surrogates and non-finite floats are 400s naming the
OpenAI parameter (``messages[0].content``, never a gRPC field path), not bare 500s; and every
400 the replica sends back names the parameter in the caller's terms."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from llmrpc.clients import ErrorDetails, FieldViolation, LlmrpcError
from llmrpc.gateway.errors import from_grpc
from llmrpc.gateway.param_names import CHAT_PARAMS

MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONE = "\ud800"  # json.dumps writes it as the escape "\ud800": valid JSON, not valid Unicode


def post_json(gateway, path: str, body: dict) -> httpx.Response:
    """POST ``body`` as JSON with non-ASCII escaped, so lone surrogates can travel."""
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(gateway.url + path, content=content, headers=headers, timeout=60)


def assert_400(reply: httpx.Response, param: str) -> dict:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 10**10}, "max_tokens"),
        ({"top_k": 2**40}, "top_k"),
        ({"n": 2**33}, "n"),
        ({"priority": 2**40}, "priority"),
        ({"priority": -(2**40)}, "priority"),
        ({"truncate_prompt_tokens": 2**40}, "truncate_prompt_tokens"),
        ({"min_tokens": 2**40}, "min_tokens"),
        ({"logprobs": 2**40}, "logprobs"),
        ({"prompt_logprobs": 2**40}, "prompt_logprobs"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids[0]"),
        ({"allowed_token_ids": [1, 2**40]}, "allowed_token_ids[1]"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {"99999999999": 1.0}}, "logit_bias"),
        ({"prompt": [-1]}, "prompt[0]"),
        ({"prompt": [[1, 2], [3, 2**40]]}, "prompt[1][1]"),
        ({"temperature": 1e300}, "temperature"),
        ({"prompt": LONE}, "prompt"),
        ({"prompt": ["fine", "x" + LONE]}, "prompt[1]"),
        ({"stop": ["fine", LONE]}, "stop[1]"),
        ({"bad_words": [LONE]}, "bad_words[0]"),
        ({"model": LONE}, "model"),
    ],
)
def test_completion_fields_beyond_the_api_are_400s(gateway, body, param):
    assert_400(post_json(gateway, COMPLETIONS, {"prompt": "x", **body}), param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
        ({"messages": [*MESSAGES, {"role": LONE, "content": "x"}]}, "messages[1].role"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
         "messages[0].content[0].text"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 2**40}, "top_logprobs"),
        ({"chat_template_kwargs": {"x": LONE}}, "chat_template_kwargs.x"),
        ({"stop": LONE}, "stop"),
    ],
)  # fmt: skip
def test_chat_fields_beyond_the_api_are_400s(gateway, body, param):
    assert_400(post_json(gateway, CHAT, {"messages": MESSAGES, **body}), param)


def test_tokenization_fields_beyond_the_api_are_400s(gateway):
    assert_400(post_json(gateway, "/detokenize", {"tokens": [1, 2**40]}), "tokens[1]")
    assert_400(post_json(gateway, "/tokenize", {"prompt": LONE}), "prompt")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_400s(gateway, constant):
    content = f'{{"prompt": "x", "top_p": {constant}}}'.encode()
    headers = {"content-type": "application/json"}
    reply = httpx.post(gateway.url + COMPLETIONS, content=content, headers=headers, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_escaped_surrogate_pairs_are_fine(gateway):
    body = {"prompt": "smile \U0001f600", "max_tokens": 1}  # sent as "\ud83d\ude00"
    assert post_json(gateway, COMPLETIONS, body).status_code == 200


def test_the_replicas_max_tokens_error_names_max_completion_tokens(gateway):
    body = {"messages": MESSAGES, "max_completion_tokens": 100000}
    error = assert_400(post_json(gateway, CHAT, body), "max_completion_tokens")
    assert "stopping." not in error["message"]


# --- gRPC field paths -> OpenAI parameters -----------------------------------------------------


def _violation(field: str) -> LlmrpcError:
    details = ErrorDetails(field_violations=(FieldViolation(field, "is wrong"),))
    return LlmrpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: is wrong", details)


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("stopping.max_tokens", "max_tokens"),
        ("stopping.stop[1]", "stop[1]"),
        ("sampling.logit_bias", "logit_bias"),
        ("text", "prompt"),
        ("token_ids", "prompt"),
        ("token_ids.ids[3]", "prompt[3]"),
        ("model", "model"),
        ("truncate_prompt_tokens", "truncate_prompt_tokens"),
    ],
)
def test_completion_field_paths_become_parameters(field, param):
    error = from_grpc(_violation(field))
    assert error.param == param
    assert error.message == f"{param}: is wrong"  # the caller's name, not the gRPC path


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("chat.messages[0].content", "messages[0].content"),
        ("chat.messages", "messages"),
        ("chat", "messages"),
        ("text", "messages"),
        ("output.prompt_logprobs", "prompt_logprobs"),
        ("output.logprobs", "top_logprobs"),
        ("chat.chat_template", "chat_template"),
        ("stopping.stop[0]", "stop[0]"),
    ],
)
def test_chat_field_paths_become_parameters(field, param):
    error = from_grpc(_violation(field), CHAT_PARAMS)
    assert error.param == param
    assert error.message == f"{param}: is wrong"


# --- large bodies: parsed and validated on a worker thread, with the same answers ----------------

BIG = 40_000  # token ids: a body well above json_body.OFF_LOOP_BYTES


def test_a_large_body_names_the_bad_element(gateway):
    reply = post_json(gateway, COMPLETIONS, {"prompt": [1] * BIG + [2**40]})
    assert_400(reply, f"prompt[{BIG}]")
    long_text = "word " * BIG
    messages = [{"role": "user", "content": long_text}, {"role": "user", "content": LONE}]
    assert_400(post_json(gateway, CHAT, {"messages": messages}), "messages[1].content")


def test_a_large_valid_body_is_served(gateway):
    reply = post_json(gateway, "/tokenize", {"prompt": "word " * BIG})
    assert reply.status_code == 200, reply.text
    assert reply.json()["count"] >= BIG
    allowed = list(range(BIG))  # a large list the request honours (an unknown one is dropped)
    body = {"prompt": [1] * 100, "max_tokens": 1, "allowed_token_ids": allowed}
    reply = post_json(gateway, COMPLETIONS, body)
    assert reply.status_code == 200, reply.text


def test_tokenization_errors_from_the_replica_name_the_rest_parameters(gateway):
    error = assert_400(post_json(gateway, "/detokenize", {"tokens": [1, 10**9]}), "tokens")
    assert "token_ids" not in error["message"]
