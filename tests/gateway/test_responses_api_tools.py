"""``/v1/responses`` with function tools and reasoning, through the official OpenAI SDK against
the real gateway and a real gRPC replica of the tiny model that reads hermes tool calls and
qwen3 reasoning. The model's outputs are scripted (``scripted_outputs``): the real engine runs,
its sampler's choices replaced for the scripted requests, whose ids the gateway passes on from
``X-Request-Id``."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import openai
import pytest
from conftest import in_process_gateway
from envoy_support import Replica, ServerLoop, tiny_engine_config
from gateway_support import RunningGateway
from scripted_outputs import TOOL_TEMPLATE, script

from llmrpc.clients import ChatOptions
from llmrpc.server.settings import FrontendConfig, ParsingConfig

GREEDY = {"model": "", "temperature": 0.0, "max_output_tokens": 6}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
THOUGHT = "The user wants the weather."


@pytest.fixture(scope="module")
def replica(server_loop: ServerLoop, tiny_llama_dir) -> Iterator[Replica]:
    """Its engine on a thread, so outputs can be scripted; a chat template that shows tools,
    calls, their results and the reasoning of a turn that made calls."""
    parsing = ParsingConfig(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    frontend = FrontendConfig(
        host="127.0.0.1",
        grpc_port=0,
        disable_frontend_multiprocessing=True,
        chat_template=TOOL_TEMPLATE,
        parsing=parsing,
    )
    started = server_loop.start_replica(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(server_loop: ServerLoop, replica: Replica) -> Iterator[RunningGateway]:
    yield from in_process_gateway(server_loop, replica)


@pytest.fixture
def scripted(gateway, replica):
    def arguments(text: str) -> dict:
        """What makes the next request generate ``text`` (then EOS): its request id, and
        room for the text."""
        rid = f"resp-{uuid.uuid4().hex[:8]}"
        num_tokens = gateway.server_loop.run(script(replica.running, rid, text))
        return {"extra_headers": {"x-request-id": rid}, "max_output_tokens": num_tokens + 1}

    return arguments


def test_a_parsed_call_is_a_function_call_item(sdk, scripted):
    kwargs = {"model": "", "input": "Weather in Paris?", "tools": TOOLS}
    response = sdk.responses.create(**kwargs, **scripted("Let me check. " + CALL))
    assert response.status == "completed"
    message, call = response.output
    assert message.content[0].text == "Let me check. " == response.output_text
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert response.tools[0].name == "get_weather" and response.tool_choice == "auto"
    events = list(sdk.responses.create(**kwargs, stream=True, **scripted(CALL)))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds  # the call alone: no text
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    [streamed] = events[-1].response.output
    assert streamed.name == "get_weather"
    assert json.loads(streamed.arguments) == {"city": "Paris", "days": 2}


def test_a_named_tool_choice_forces_its_call(sdk, scripted):
    choice = {"type": "function", "name": "get_weather"}
    arguments = scripted('{"city":"Oslo"}')
    response = sdk.responses.create(
        model="", input="Hi", tools=TOOLS, tool_choice=choice, **arguments
    )
    [call] = response.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Oslo"}
    assert response.tool_choice.name == "get_weather"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(input="Hi", tools=TOOLS, tool_choice={**choice, "name": "x"}, **GREEDY)
    assert caught.value.body["param"] == "tool_choice.name"


def _prompt_of(grpc_client, messages) -> tuple[int, str]:
    tokens = grpc_client.tokenize(messages=messages, chat_options=ChatOptions(tools=CHAT_TOOLS))
    return tokens.count, grpc_client.detokenize(tokens.token_ids)


def test_a_call_its_reasoning_and_its_output_reach_the_next_prompt(sdk, scripted, grpc_client):
    output = f"<think>{THOUGHT}</think>{CALL}"
    first = sdk.responses.create(model="", input="Weather?", tools=TOOLS, **scripted(output))
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    chained = sdk.responses.create(
        input=[result], previous_response_id=first.id, tools=TOOLS, **GREEDY
    )
    # The same turn with the state kept by the caller: the first output sent back as input.
    sent_back = [{"role": "user", "content": "Weather?"}, *first.output, result]
    manual = sdk.responses.create(input=sent_back, tools=TOOLS, **GREEDY)
    function = {"name": "get_weather", "arguments": call.arguments}
    calls = [{"id": call.call_id, "type": "function", "function": function}]
    count, prompt = _prompt_of(grpc_client, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": calls},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"},
    ])  # fmt: skip
    assert f"<think>{THOUGHT}</think>" in prompt
    assert f"<tool_response id={call.call_id}>\n18 C\n</tool_response>" in prompt
    assert '"arguments": {"city": "Paris", "days": 2}' in prompt
    assert chained.usage.input_tokens == manual.usage.input_tokens == count


def test_reasoning_is_its_own_item_whole_and_streamed(sdk, scripted, grpc_client):
    output = f"<think>\n{THOUGHT}\n</think>\n\nIt is sunny."
    response = sdk.responses.create(model="", input="Weather?", **scripted(output))
    reasoning, message = response.output
    assert reasoning.content[0].text == f"\n{THOUGHT}\n" and reasoning.summary == []
    assert message.content[0].text == response.output_text == "\n\nIt is sunny."
    reasoning_tokens = grpc_client.tokenize(f"\n{THOUGHT}\n", add_special_tokens=False).count
    assert response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens > 0
    events = list(sdk.responses.create(model="", input="Weather?", stream=True, **scripted(output)))
    kinds = [e.type for e in events]
    # streamed as it comes: in more than one delta (a lagging reader gets merged deltas)
    assert kinds.count("response.reasoning_text.delta") > 1
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == f"\n{THOUGHT}\n"
    final = events[-1].response
    assert final.status == "completed"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == reasoning_tokens
