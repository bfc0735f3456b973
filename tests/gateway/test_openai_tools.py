"""Tool calls and reasoning through the REST gateway and the OpenAI SDK: calls and reasoning
come back as OpenAI (and vLLM) shape them, whole and streamed; the SDK's own stream accumulator
rebuilds them; the history the SDK sends back (assistant calls, tool results) reaches the chat
template; tool_choice required and a named function make their calls. The replica runs
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3 with a tool
template; its outputs are scripted (``scripted_outputs``)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from envoy_support import Replica, ServerLoop, tiny_engine_config
from gateway_support import RunningGateway, post, running_gateway, sse_json
from scripted_outputs import TOOL_TEMPLATE, script

from llmrpc.engine.config import StructuredOutputConfig
from llmrpc.server.settings import FrontendConfig, ParsingConfig

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone"}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time?"}]
WEATHER_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_replica(server_loop: ServerLoop, tiny_llama_dir) -> Iterator[Replica]:
    parsing = ParsingConfig(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    frontend = FrontendConfig(
        host="127.0.0.1",
        grpc_port=0,
        disable_frontend_multiprocessing=True,  # scripts run in the engine core's thread
        chat_template=TOOL_TEMPLATE,
        parsing=parsing,
    )
    # Forced calls without optional whitespace: a random model would spend max_tokens on it.
    structured = StructuredOutputConfig(disable_any_whitespace=True)
    config = dataclasses.replace(tiny_engine_config(tiny_llama_dir), structured_output=structured)
    started = server_loop.start_replica(config, frontend=frontend)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def tool_gateway(server_loop: ServerLoop, tool_replica: Replica) -> Iterator[RunningGateway]:
    with running_gateway(server_loop, [tool_replica.address]) as gateway:  # over the network
        yield gateway


@pytest.fixture(scope="module")
def sdk(tool_gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_gateway.url + "/v1", api_key="unused", max_retries=0)


class Scripts:
    def __init__(self, server_loop: ServerLoop, replica: Replica) -> None:
        self.server_loop = server_loop
        self.running = replica.running

    def __call__(self, *texts: str) -> tuple[dict, int]:
        """Headers that make a request generate ``texts`` (one per choice), and its
        max_tokens."""
        rid = f"rest-tools-{uuid.uuid4().hex[:8]}"
        num_tokens = self.server_loop.run(script(self.running, rid, *texts))
        return {"X-Request-Id": rid}, num_tokens + 1


@pytest.fixture(scope="module")
def scripted(server_loop, tool_replica) -> Scripts:
    return Scripts(server_loop, tool_replica)


def create(sdk, scripted, *texts: str, **kwargs):
    headers, max_tokens = scripted(*texts)
    kwargs = {"tools": TOOLS, "max_tokens": max_tokens, **kwargs}
    return sdk.chat.completions.create(
        model="", messages=kwargs.pop("messages", MESSAGES), extra_headers=headers, **kwargs
    )


def arguments(call) -> dict:
    return json.loads(call.function.arguments)


# --- answers ----------------------------------------------------------------------------------


def test_the_sdk_reads_calls_content_and_finish_reason(sdk, scripted):
    completion = create(sdk, scripted, "Let me check. " + WEATHER_CALL)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and arguments(call) == {"city": "Paris", "days": 2}
    plain = create(sdk, scripted, "No tools needed.")
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls


def test_calls_alone_have_null_content_and_reasoning_has_both_names(tool_gateway, scripted):
    headers, max_tokens = scripted("<think>Two calls.</think>" + WEATHER_CALL + TIME_CALL)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": max_tokens}
    reply = post(tool_gateway, "/v1/chat/completions", body, headers=headers)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["content"] is None
    assert message["reasoning_content"] == message["reasoning"] == "Two calls."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert set(message["tool_calls"][0]) == {"id", "type", "function"}


def test_streamed_calls_are_sent_as_openai_sends_them(tool_gateway, scripted):
    headers, max_tokens = scripted("<think>Both.</think>On it." + WEATHER_CALL + TIME_CALL)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": max_tokens, "stream": True}
    reply = post(tool_gateway, "/v1/chat/completions", body, headers=headers)
    assert reply.status_code == 200, reply.text
    deltas = [chunk["choices"][0] for chunk in sse_json(reply.content)]
    reasoning = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert (reasoning, content) == ("Both.", "On it.")
    tool_deltas = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    header, fragment = tool_deltas[0], tool_deltas[1]
    assert header == {
        "index": 0,
        "id": header["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert fragment == {"index": 0, "function": {"arguments": '{"city": "Paris", "days": 2}'}}
    assert [(t["index"], "id" in t) for t in tool_deltas] == [
        (0, True),
        (0, False),
        (1, True),
        (1, False),
    ]
    assert tool_deltas[3]["function"] == {"arguments": "{}"}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert all(d["finish_reason"] is None for d in deltas[:-1])


def test_the_sdks_stream_accumulator_rebuilds_the_calls(sdk, scripted):
    headers, max_tokens = scripted("Sure." + WEATHER_CALL + TIME_CALL)
    with sdk.chat.completions.stream(
        model="", messages=MESSAGES, tools=TOOLS, max_tokens=max_tokens, extra_headers=headers
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    calls = choice.message.tool_calls
    assert [(c.function.name, arguments(c)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2


def test_malformed_calls_are_content(sdk, scripted):
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    choice = create(sdk, scripted, text).choices[0]
    assert choice.message.content == text and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_include_reasoning_false_leaves_the_reasoning_out(tool_gateway, scripted):
    headers, max_tokens = scripted("<think>Hidden.</think>Shown.")
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "include_reasoning": False}
    message = post(tool_gateway, "/v1/chat/completions", body, headers=headers).json()
    message = message["choices"][0]["message"]
    assert message["content"] == "Shown." and "reasoning_content" not in message


# --- the history ------------------------------------------------------------------------------


def test_the_sdks_own_answer_goes_back_as_history(sdk, scripted, tool_gateway):
    first = create(sdk, scripted, "<think>Look it up.</think>" + WEATHER_CALL)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [
        *MESSAGES,
        message,  # as SDK users send it back: the SDK's own object
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    second = create(sdk, scripted, "It is sunny.", messages=history)
    assert second.choices[0].message.content == "It is sunny."
    sent = [
        {"role": "user", "content": MESSAGES[0]["content"]},
        message.model_dump(exclude_unset=True),
        history[2],
    ]
    reply = post(tool_gateway, "/tokenize", {"messages": sent, "tools": TOOLS})
    assert reply.status_code == 200, reply.text
    ids = reply.json()["tokens"]
    prompt = post(tool_gateway, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in prompt
    assert f"<tool_response id={call.id}>\n18 C, sunny\n</tool_response>" in prompt
    assert "<think>Look it up.</think>" in prompt


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tools": []}, "tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"store": True}, "store"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_parameter(tool_gateway, extra, param):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, **extra}
    body = {name: value for name, value in body.items() if value is not None}
    reply = post(tool_gateway, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param), error


def test_the_sdks_optional_parameters_are_accepted(sdk, scripted):
    completion = create(
        sdk, scripted, "Fine.",
        user="someone", metadata={"team": "a"}, store=False, service_tier="auto",
        parallel_tool_calls=False, reasoning_effort="low", seed=3, tool_choice="auto",
    )  # fmt: skip
    assert completion.choices[0].message.content == "Fine."


def test_auto_tool_choice_without_the_flags_says_which_flags(server_loop, tiny_llama_dir):
    config = tiny_engine_config(tiny_llama_dir)
    plain = server_loop.start_replica(dataclasses.replace(config), port=0)
    try:
        with running_gateway(server_loop, [plain.address]) as gateway:
            body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
            reply = post(gateway, "/v1/chat/completions", body)
            required = post(gateway, "/v1/chat/completions", {**body, "tool_choice": "none"})
    finally:
        plain.stop()
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in reply.json()["error"]["message"]
    assert required.status_code == 200, required.text


# --- the real model under a forced choice -------------------------------------------------------

UNIT = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "ok": {"type": "boolean"},
    },
    "required": ["unit", "days", "ok"],
}


FORCED_TOOLS = [
    {"type": "function", "function": {"name": "convert", "parameters": UNIT}},
    {
        "type": "function",
        "function": {"name": "reset", "parameters": {"type": "object", "properties": {}}},
    },
]
NAMED = {"type": "function", "function": {"name": "convert"}}


@pytest.mark.parametrize(("tool_choice", "names"), [("required", None), (NAMED, ["convert"])])
def test_a_random_model_under_a_forced_choice_makes_calls_valid_against_the_schema(
    sdk, tool_choice, names
):
    """No script: the random-weight model's own tokens, held by the grammar (compact JSON: the
    replica runs --guided-decoding-disable-any-whitespace)."""
    for seed in range(3):
        completion = sdk.chat.completions.create(
            model="", messages=MESSAGES, tools=FORCED_TOOLS, tool_choice=tool_choice, seed=seed,
            temperature=1.0, max_tokens=200, parallel_tool_calls=False,
        )  # fmt: skip
        choice = completion.choices[0]
        # as OpenAI: a call the model chose ends with "tool_calls", a named one with "stop"
        assert choice.finish_reason == ("stop" if names else "tool_calls")
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert names is None or [call.function.name] == names
        tool = next(t for t in FORCED_TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(arguments(call), tool["function"]["parameters"])


def test_a_named_call_cut_by_max_tokens_is_a_call_with_finish_reason_length(sdk):
    """As vLLM: the arguments written so far, in tool_calls, whole and streamed."""
    request = {"model": "", "messages": MESSAGES, "tools": FORCED_TOOLS, "tool_choice": NAMED}
    request.update(seed=1, temperature=1.0, max_tokens=3)
    choice = sdk.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "convert" and call.function.arguments.startswith("{")
    chunks = list(sdk.chat.completions.create(**request, stream=True))
    streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert "".join(c.function.arguments or "" for c in streamed) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"
