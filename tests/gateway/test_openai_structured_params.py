"""OpenAI's response_format and vLLM's structured_outputs / guided_* reach the gRPC API's
structured_output from completions and chat (the tiny model's output then holds to them), and
their errors name the parameter the caller used. The replica runs
--guided-decoding-disable-any-whitespace: with optional whitespace allowed, a random-weight
model spends its tokens on it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import jsonschema
import pytest
from envoy_support import Replica, ServerLoop, tiny_engine_config
from gateway_support import RunningGateway, post, running_gateway

from llmrpc.engine.config import StructuredOutputConfig

MESSAGES = [{"role": "user", "content": "Pick one"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "count"],
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
SAMPLED = {"temperature": 1.0, "max_tokens": 40, "n": 3, "seed": 5}


@pytest.fixture(scope="module")
def compact_replica(server_loop: ServerLoop, tiny_llama_dir) -> Iterator[Replica]:
    config = tiny_engine_config(tiny_llama_dir)
    structured = StructuredOutputConfig(disable_any_whitespace=True)
    started = server_loop.start_replica(
        dataclasses.replace(config, structured_output=structured), port=0
    )
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(server_loop: ServerLoop, compact_replica: Replica) -> Iterator[RunningGateway]:
    with running_gateway(server_loop, [compact_replica.address]) as started:
        yield started


@pytest.fixture(scope="module")
def hasty_gateway(server_loop: ServerLoop, tiny_llama_dir) -> Iterator[RunningGateway]:
    """A replica whose grammars have 1 ms to compile."""
    config = tiny_engine_config(tiny_llama_dir)
    structured = StructuredOutputConfig(compile_timeout_s=0.001)
    replica = server_loop.start_replica(
        dataclasses.replace(config, structured_output=structured), port=0
    )
    with running_gateway(server_loop, [replica.address]) as started:
        yield started
    replica.stop()


def test_guided_choice_holds_a_completion(gateway):
    body = {"prompt": "Answer:", "guided_choice": ["yes", "no"], **SAMPLED}
    reply = post(gateway, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert {choice["text"] for choice in reply.json()["choices"]} <= {"yes", "no"}


@pytest.mark.parametrize(
    "constraint",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            }
        },
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": SCHEMA},
    ],
)
def test_a_json_schema_holds_a_chat_answer(gateway, constraint):
    body = {"messages": MESSAGES, **constraint, **SAMPLED, "max_tokens": 120}
    reply = post(gateway, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    for choice in reply.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


@pytest.mark.parametrize(
    ("path", "constraint", "param"),
    [
        ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"regex": "["}},
            "structured_outputs.regex",
        ),
        ("/v1/chat/completions", {"guided_json": {"type": 7}}, "guided_json"),
        ("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_parameter(gateway, path, constraint, param):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}
    reply = post(gateway, path, {**body, **constraint, "max_tokens": 2})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()


def test_a_grammar_past_the_compile_timeout_is_a_400_naming_response_format(hasty_gateway):
    # 10,000 values: about 0.1 s of compiling on one core, a hundred times the replica's bound
    schema = {"enum": [f"v{i}" for i in range(10_000)]}
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    body = {"messages": MESSAGES, "response_format": fmt, "max_tokens": 2}
    reply = post(hasty_gateway, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "response_format.json_schema.schema", error
    assert "--structured-output-compile-timeout" in error["message"], error
    free = post(hasty_gateway, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    assert free.status_code == 200, free.text


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},  # refers to itself, and nothing else: no value is ever complete
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"not": {}},  # admits no value
        {"type": "object", "properties": {"x": {"not": {}}}, "required": ["x"]},
    ],
)
def test_a_schema_that_admits_nothing_is_a_400_naming_response_format(gateway, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "none", "schema": schema}}
    body = {"messages": MESSAGES, "response_format": fmt, "max_tokens": 4}
    reply = post(gateway, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "response_format.json_schema.schema", reply.json()
    free = post(gateway, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    assert free.status_code == 200, free.text
