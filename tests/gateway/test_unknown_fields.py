"""Request fields the gateway does not know: ignored with a warning, as vLLM does (a client
updated for a new OpenAI field keeps working), or a 400 naming them under
``--strict-request-fields``. Fields it knows and cannot honour are a 400 either way."""

from __future__ import annotations

import logging

import pytest
from gateway_support import post, running_gateway

from llmrpc.gateway import request_fields

MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0.0}
# (path, body with unknown fields, the names a warning gives)
UNKNOWN = [
    ("/v1/chat/completions", {**CHAT, "new_openai_field": {"a": 1}, "guided_jsn": {}},
     {"new_openai_field", "guided_jsn"}),
    ("/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "Hi", "name_v2": "x"}]}, {"name_v2"}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "cache_hint": "x"}, {"cache_hint"}),
    ("/v1/embeddings", {"input": "Hi", "encoding": "float"}, {"encoding"}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "prompt_cache_retention": "24h"},
     {"prompt_cache_retention"}),
    ("/tokenize", {"prompt": "Hi", "lang": "en"}, {"lang"}),
]  # fmt: skip
UNKNOWN_IDS = [f"{path}-{sorted(names)[0]}" for path, _, names in UNKNOWN]


@pytest.fixture(autouse=True)
def fresh_log():
    """Each test sees the first warning for each name."""
    request_fields.IGNORED_LOG.reset()


def _warned(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == request_fields.logger.name]


@pytest.mark.parametrize(("path", "body", "names"), UNKNOWN, ids=UNKNOWN_IDS)
def test_unknown_fields_are_ignored_with_one_warning_a_name(gateway, caplog, path, body, names):
    with caplog.at_level(logging.WARNING, logger=request_fields.logger.name):
        first = post(gateway, path, body)
        again = post(gateway, path, body)
    assert first.status_code == 200, first.text
    assert again.status_code == 200, again.text
    warned = _warned(caplog)
    assert len(warned) == len(names), warned  # once a name, not once a request
    for name in names:
        assert any(f"'{name}'" in line and "ignored" in line for line in warned), warned


def test_the_same_answer_as_without_the_unknown_fields(gateway):
    plain = post(gateway, "/v1/chat/completions", CHAT).json()
    extra = post(gateway, "/v1/chat/completions", {**CHAT, "verbosity_v2": "low"}).json()
    assert extra["choices"][0]["message"] == plain["choices"][0]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({**CHAT, "verbosity": "low"}, "verbosity"),
        ({**CHAT, "web_search_options": {}}, "web_search_options"),
    ],
)
def test_fields_it_knows_and_cannot_honour_stay_a_400(gateway, body, param):
    reply = post(gateway, "/v1/chat/completions", body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.fixture(scope="module")
def strict_gateway(server_loop, replica):
    with running_gateway(server_loop, [replica.address], api={"strict_request_fields": True}) as g:
        yield g


@pytest.mark.parametrize(("path", "body", "names"), UNKNOWN, ids=UNKNOWN_IDS)
def test_strict_request_fields_refuse_them_naming_one(strict_gateway, caplog, path, body, names):
    with caplog.at_level(logging.WARNING, logger=request_fields.logger.name):
        reply = post(strict_gateway, path, body)
    assert reply.status_code == 400, reply.text
    param = reply.json()["error"]["param"]
    assert param.rsplit(".", 1)[-1] in names, param
    assert not _warned(caplog)


def test_the_log_of_ignored_names_is_bounded():
    log = request_fields.IgnoredFieldLog(max_names=3, interval_s=600)
    assert [log.due(name) for name in ("a", "b", "a", "c")] == [True, True, False, True]
    assert log.due("d") is True and log.due("e") is False  # past the bound: one line for all
    assert log.due("f") is False and log.due("a") is False


def test_a_body_validated_in_the_parser_process_follows_the_same_policy(
    gateway, strict_gateway, caplog
):
    """Past parser_process.OFF_PROCESS_BYTES the body is validated in another process, which is
    told the policy and sends the dropped names back."""
    body = {"prompt": "Hi " * 400_000, "max_tokens": 1, "cache_hint": 1}  # 1.2 MB
    with caplog.at_level(logging.WARNING, logger=request_fields.logger.name):
        reply = post(gateway, "/v1/completions", body)
    assert reply.json()["error"]["param"] == "prompt", reply.text  # too long for the model
    assert any("'cache_hint'" in line for line in _warned(caplog))
    reply = post(strict_gateway, "/v1/completions", body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_hint"


def test_a_request_of_many_unknown_names_logs_a_few_and_costs_little(gateway, caplog):
    """A thousand messages with a name of their own each: at most MAX_UNKNOWN_REPORTED lines."""
    messages = [{"role": "user", "content": "Hi", f"x{i}": 1} for i in range(1000)]
    with caplog.at_level(logging.WARNING, logger=request_fields.logger.name):
        post(gateway, "/tokenize", {"messages": messages})
    assert 1 <= len(_warned(caplog)) <= request_fields.MAX_UNKNOWN_REPORTED
