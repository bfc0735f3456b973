"""Tool calling over gRPC: tools and the call history reach the chat template; the calls in a
chat's output come back as ``tool_calls`` (whole, and streamed once each where they complete);
tool_choice required or a function holds the random-weight model's own output to the tools'
schemas, and the calls it makes validate; bad tools are INVALID_ARGUMENT naming the field.
Outputs under tool_choice auto are scripted (``scripted_outputs``): the real engine runs, its
sampler's choices replaced for the scripted requests. (Forced outputs are not scripted: the
grammar holds an object's keys to its schema's order, which a Struct does not keep.)"""

from __future__ import annotations

import dataclasses
import json
import uuid

import grpc
import jsonschema
import pytest
import pytest_asyncio
from engine_pace import restore_speed, slow_down
from scripted_outputs import TOOL_TEMPLATE, script
from server_utils import field_violations, frontend_config, tiny_engine_config

from llmrpc.engine.config import StructuredOutputConfig
from llmrpc.server.app import start_server
from llmrpc.server.settings import ParsingConfig
from llmrpc.server.tool_calling import ToolMode, ToolPlan, forced_calls, forced_schema
from llmrpc.server.tool_parsers import FunctionCall
from llmrpc.v1 import common_pb2, generation_pb2, tokenization_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
SECOND = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir):
    parsing = ParsingConfig(
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        exclude_tools_when_tool_choice_none=True,
    )
    frontend = frontend_config("thread", chat_template=TOOL_TEMPLATE, parsing=parsing)
    # --guided-decoding-disable-any-whitespace: a random model would spend its tokens on it.
    structured = StructuredOutputConfig(disable_any_whitespace=True)
    config = dataclasses.replace(tiny_engine_config(tiny_llama_dir), structured_output=structured)
    running = await start_server(config, frontend=frontend)
    yield running
    await running.stop(grace=0)


def tool(name: str, parameters: dict | None = None) -> common_pb2.Tool:
    proto = common_pb2.Tool(type="function")
    proto.function.name = name
    proto.function.description = f"{name} of a place"
    if parameters is not None:
        proto.function.parameters = json.dumps(parameters)
    return proto


TIME = {"type": "object", "properties": {"zone": {"type": "string"}}}
TOOLS = [tool("get_weather", WEATHER), tool("get_time", TIME)]


def chat_request(rid: str, max_tokens: int, choice=None, n: int = 1, **chat) -> dict:
    tool_choice = {} if choice is None else {"tool_choice": choice}
    return generation_pb2.GenerateRequest(
        request_id=rid,
        chat=common_pb2.Chat(
            messages=[common_pb2.ChatMessage(role="user", content="Weather in Paris?")],
            tools=chat.pop("tools", TOOLS),
            **tool_choice,
            **chat,
        ),
        sampling=common_pb2.SamplingParams(n=n, temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens + 1),
    )


async def scripted(server, *texts: str, choice=None, n: int = 1, cut: int | None = None, **chat):
    """A request that generates ``texts`` (one per sample); ``cut``: its max_tokens."""
    rid = f"tools-{uuid.uuid4().hex[:8]}"
    num_tokens = await script(server, rid, *texts)
    request = chat_request(rid, num_tokens, choice, n, **chat)
    if cut is not None:
        request.stopping.max_tokens = cut
    return request


def calls_of(tool_calls) -> list[tuple[int, str, dict]]:
    return [(c.index, c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


async def read_stream(generation, request) -> list[generation_pb2.GenerateResponse]:
    return [message async for message in generation.GenerateStream(request)]


# --- output -----------------------------------------------------------------------------------


async def test_a_call_is_parsed_out_of_the_content(server, generation):
    request = await scripted(server, "Let me check. " + CALL)
    response = await generation.Generate(request)
    assert response.text == "Let me check. "
    assert calls_of(response.tool_calls) == [(0, "get_weather", {"city": "Paris", "days": 2})]
    call = response.tool_calls[0]
    assert call.id.startswith("call_") and len(call.id) > 10 and call.type == "function"
    assert response.finish_reason == generation_pb2.FINISH_REASON_EOS  # the engine's, on gRPC


async def test_streamed_calls_come_once_each_where_their_text_completes(server, generation):
    request = await scripted(server, "Checking both.\n" + CALL + "\n" + SECOND)
    slow_down(server.engine, 0.02)  # (a reader that lags the engine gets its deltas merged)
    try:
        messages = await read_stream(generation, request)
    finally:
        restore_speed(server.engine)
    assert len(messages) > 10  # token by token
    assert "".join(m.text for m in messages) == "Checking both.\n\n"
    with_calls = [i for i, m in enumerate(messages) if m.tool_calls]
    assert len(with_calls) == 2 and with_calls[0] < with_calls[1]
    calls = [c for m in messages for c in m.tool_calls]
    assert calls_of(calls) == [
        (0, "get_weather", {"city": "Paris", "days": 2}),
        (1, "get_time", {"zone": "CET"}),
    ]
    assert len({c.id for c in calls}) == 2
    # No marker of a call ever reaches the content, and a call arrives as its text completes.
    assert not any("<tool" in m.text for m in messages)
    assert with_calls[1] < len(messages) - 1 or messages[-1].finish_reason


async def test_each_sample_is_parsed_on_its_own(server, generation):
    request = await scripted(server, CALL, "No tools needed.", n=2)
    response = await generation.Generate(request)
    first, second = response.samples
    assert calls_of(first.tool_calls) == [(0, "get_weather", {"city": "Paris", "days": 2})]
    assert first.text == "" and not second.tool_calls and second.text == "No tools needed."
    assert response.tool_calls == first.tool_calls  # the top level is sample 0, same ids
    request = await scripted(server, "Sure. " + SECOND, CALL, n=2)
    messages = await read_stream(generation, request)
    by_index = {i: [m for m in messages if m.index == i] for i in (0, 1)}
    assert "".join(m.text for m in by_index[0]) == "Sure. "
    assert calls_of([c for m in by_index[0] for c in m.tool_calls]) == [
        (0, "get_time", {"zone": "CET"})
    ]
    assert calls_of([c for m in by_index[1] for c in m.tool_calls])[0][1] == "get_weather"


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call> after",
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut short
    ],
)
async def test_malformed_calls_are_content_whole_and_streamed(server, generation, text):
    request = await scripted(server, text)
    response = await generation.Generate(request)
    assert response.text == text and not response.tool_calls
    request = await scripted(server, text)
    messages = await read_stream(generation, request)
    assert "".join(m.text for m in messages) == text
    assert not any(m.tool_calls for m in messages)


async def test_parallel_tool_calls_false_keeps_the_first_call(server, generation):
    request = await scripted(server, CALL + SECOND, parallel_tool_calls=False)
    response = await generation.Generate(request)
    assert [name for _, name, _ in calls_of(response.tool_calls)] == ["get_weather"]


async def test_tool_choice_none_leaves_the_text_as_it_is(server, generation):
    none = common_pb2.ToolChoice(mode=common_pb2.ToolChoice.MODE_NONE)
    request = await scripted(server, CALL, choice=none)
    response = await generation.Generate(request)
    assert response.text == CALL and not response.tool_calls


# --- forced calls: the random-weight model's own tokens, held by the grammar ------------------

# Values a random model finishes quickly (no free strings); the server writes compact JSON.
CONVERT = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "exact": {"type": "boolean"}},
    "required": ["unit", "exact"],
}
FORCED_TOOLS = [tool("convert", CONVERT), tool("reset", {"type": "object", "properties": {}})]


def forced_request(choice: common_pb2.ToolChoice, seed: int, max_tokens: int = 120, **chat):
    request = chat_request(f"forced-{uuid.uuid4().hex[:8]}", max_tokens, choice, tools=FORCED_TOOLS)
    request.sampling.temperature, request.sampling.seed = 1.0, seed
    for name, value in chat.items():
        setattr(request.chat, name, value)
    return request


def valid_calls(tool_calls) -> list[str]:
    """The calls' names, each call's arguments checked against its tool's schema."""
    schemas = {t.function.name: json.loads(t.function.parameters) for t in FORCED_TOOLS}
    for call in tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return [call.function.name for call in tool_calls]


async def test_a_named_function_makes_its_call(generation):
    choice = common_pb2.ToolChoice(function_name="convert")
    for seed in range(2):
        response = await generation.Generate(forced_request(choice, seed))
        assert response.finish_reason == generation_pb2.FINISH_REASON_EOS
        assert valid_calls(response.tool_calls) == ["convert"] and response.text == ""
    messages = await read_stream(generation, forced_request(choice, seed=7))
    assert "".join(m.text for m in messages) == ""  # held, then read as the call
    assert valid_calls([c for m in messages for c in m.tool_calls]) == ["convert"]
    assert messages[-1].tool_calls and messages[-1].finish_reason


async def test_required_makes_the_calls_of_its_json_array(generation):
    required = common_pb2.ToolChoice(mode=common_pb2.ToolChoice.MODE_REQUIRED)
    for seed in range(2):
        request = forced_request(required, seed, parallel_tool_calls=False)
        response = await generation.Generate(request)
        assert response.finish_reason == generation_pb2.FINISH_REASON_EOS
        assert len(valid_calls(response.tool_calls)) == 1 and response.text == ""
        assert response.tool_calls[0].index == 0


async def test_forced_output_cut_by_max_tokens_is_content(generation):
    required = common_pb2.ToolChoice(mode=common_pb2.ToolChoice.MODE_REQUIRED)
    response = await generation.Generate(forced_request(required, seed=1, max_tokens=3))
    assert response.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert response.text.startswith("[") and not response.tool_calls


async def test_a_named_call_cut_by_max_tokens_keeps_its_partial_arguments(generation):
    """As vLLM: the named function's call carries the arguments written so far, whole and
    streamed, with finish reason LENGTH (a structured-output client then sees a call, not
    content it would silently drop)."""
    choice = common_pb2.ToolChoice(function_name="convert")
    response = await generation.Generate(forced_request(choice, seed=1, max_tokens=3))
    assert response.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    (call,) = response.tool_calls
    assert call.function.name == "convert" and call.id.startswith("call_")
    assert call.function.arguments.startswith("{") and response.text == ""
    messages = await read_stream(generation, forced_request(choice, seed=1, max_tokens=3))
    assert "".join(m.text for m in messages) == ""
    (streamed,) = [c for m in messages for c in m.tool_calls]
    assert streamed.function.arguments == call.function.arguments
    assert messages[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH


async def test_forced_outputs_are_read_as_vllm_writes_them():
    named, required = ToolPlan(ToolMode.NAMED, "f"), ToolPlan(ToolMode.REQUIRED)
    assert forced_calls('{"x": [1, 2]}', named) == [FunctionCall("f", '{"x": [1, 2]}')]
    two = '[{"name": "f", "parameters": {}}, {"parameters": {"a": "b"}, "name": "g"}]'
    assert forced_calls(two, required) == [FunctionCall("f", "{}"), FunctionCall("g", '{"a": "b"}')]
    for text, plan in (("[1]", named), ('{"name": "f"', required), ("[]", required)):
        assert forced_calls(text, plan) is None  # content, as written
    assert forced_calls('[{"name": "f", "parameters": NaN}]', required) is None


async def test_forced_calls_refuse_a_structured_output_of_their_own(server, generation):
    request = chat_request("forced-so", 4, common_pb2.ToolChoice(function_name="get_time"))
    request.structured_output.regex = "[a-z]+"
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(request)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == ["structured_output"]


# --- the prompt -------------------------------------------------------------------------------


def history() -> list[common_pb2.ChatMessage]:
    call = common_pb2.ToolCall(
        id="call_1",
        type="function",
        function=common_pb2.FunctionCall(name="get_weather", arguments='{"city": "Paris"}'),
    )
    return [
        common_pb2.ChatMessage(role="user", content="Weather in Paris?"),
        common_pb2.ChatMessage(
            role="assistant", tool_calls=[call], reasoning_content="The user wants weather."
        ),
        common_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="18 C, sunny"),
    ]


async def rendered(server, tokenization, chat: common_pb2.Chat) -> str:
    response = await tokenization.Tokenize(tokenization_pb2.TokenizeRequest(chat=chat))
    return server.tokenization.tokenizer.decode(response.token_ids)


async def test_tools_and_the_call_history_reach_the_template(server, tokenization):
    prompt = await rendered(server, tokenization, common_pb2.Chat(messages=history(), tools=TOOLS))
    listed = prompt.split("<tools>")[1].split("</tools>")[0]
    tools = [json.loads(line) for line in listed.splitlines() if line]
    assert tools[0]["function"]["parameters"] == WEATHER  # integers as sent, not 1.0
    assert tools[0] == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "get_weather of a place",
            "parameters": WEATHER,
        },
    }
    # The arguments reach the template as an object (tojson writes an object, not a string).
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<think>The user wants weather.</think>" in prompt
    assert "<tool_response id=call_1>\n18 C, sunny\n</tool_response>" in prompt


async def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(server, tokenization):
    none = common_pb2.ToolChoice(mode=common_pb2.ToolChoice.MODE_NONE)
    chat = common_pb2.Chat(messages=history(), tools=TOOLS, tool_choice=none)
    assert "<tools>" not in await rendered(server, tokenization, chat)
    chat.ClearField("tool_choice")
    assert "<tools>" in await rendered(server, tokenization, chat)


# --- refusals ---------------------------------------------------------------------------------


def refusal_cases():
    many = [tool(f"f{i}") for i in range(129)]
    named = common_pb2.ToolChoice(function_name="nope")
    auto = common_pb2.ToolChoice(mode=common_pb2.ToolChoice.MODE_AUTO)
    user_call = common_pb2.ChatMessage(role="user", content="x", tool_calls=[common_pb2.ToolCall()])
    return [
        ({"tools": many}, "chat.tools"),
        ({"tools": [tool("a"), tool("b"), tool("a")]}, "chat.tools[2].function.name"),
        ({"tools": [tool("a"), tool(" ")]}, "chat.tools[1].function.name"),
        ({"tools": [], "tool_choice": auto}, "chat.tool_choice"),
        ({"tool_choice": named}, "chat.tool_choice.function_name"),
        ({"messages": [user_call]}, "chat.messages[0].tool_calls"),
        ({"chat_template_kwargs": {"tools": []}}, "chat.chat_template_kwargs"),
    ]


@pytest.mark.parametrize(("chat", "field"), refusal_cases())
async def test_bad_tools_are_invalid_argument_naming_the_field(generation, chat, field):
    request = chat_request("bad-tools", 4)
    for name, value in chat.items():
        if name == "chat_template_kwargs":
            request.chat.chat_template_kwargs.update(value)
        elif name in ("tools", "messages"):
            del getattr(request.chat, name)[:]
            getattr(request.chat, name).extend(value)
        else:
            request.chat.tool_choice.CopyFrom(value)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(request)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == [field]


async def test_the_forced_schema_is_vllms():
    """REQUIRED holds the output to an array of {name, parameters} over the tools' schemas."""
    chat = common_pb2.Chat(tools=TOOLS)
    schema = forced_schema(chat, ToolPlan(ToolMode.REQUIRED, parallel=False))
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    weather = schema["items"]["anyOf"][0]
    assert weather["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert weather["properties"]["parameters"] == WEATHER
    named = forced_schema(chat, ToolPlan(ToolMode.NAMED, "get_time"))
    assert named == TIME
