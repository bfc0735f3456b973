"""Reasoning over gRPC under --reasoning-parser qwen3: a chat's output comes back split into
``reasoning_text`` and ``text``, whole and streamed; the tool parser (hermes) reads only the
answer; other inputs are left as they are. The model's outputs are scripted
(``scripted_outputs``)."""

from __future__ import annotations

import dataclasses
import json
import uuid

import pytest
import pytest_asyncio
from scripted_outputs import TOOL_TEMPLATE, script
from server_utils import frontend_config, tiny_engine_config

from llmrpc.engine.config import StructuredOutputConfig
from llmrpc.server.app import start_server
from llmrpc.server.settings import ParsingConfig
from llmrpc.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

THOUGHT = "The user greets me. I should greet back."
OUTPUT = f"<think>\n{THOUGHT}\n</think>\n\nHello there!"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir):
    parsing = ParsingConfig(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    frontend = frontend_config("thread", chat_template=TOOL_TEMPLATE, parsing=parsing)
    # --guided-decoding-disable-any-whitespace: a random model would spend its tokens on it.
    structured = StructuredOutputConfig(disable_any_whitespace=True)
    config = dataclasses.replace(tiny_engine_config(tiny_llama_dir), structured_output=structured)
    running = await start_server(config, frontend=frontend)
    yield running
    await running.stop(grace=0)


def chat(**fields) -> common_pb2.Chat:
    return common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi")], **fields)


async def scripted(server, output: str, **input_field) -> generation_pb2.GenerateRequest:
    rid = f"reason-{uuid.uuid4().hex[:8]}"
    num_tokens = await script(server, rid, output)
    return generation_pb2.GenerateRequest(
        request_id=rid,
        **(input_field or {"chat": chat()}),
        stopping=common_pb2.StoppingCriteria(max_tokens=num_tokens + 1),
    )


async def test_the_reasoning_is_split_from_the_answer(server, generation):
    response = await generation.Generate(await scripted(server, OUTPUT))
    assert response.reasoning_text == f"\n{THOUGHT}\n"
    assert response.text == "\n\nHello there!"


async def test_streamed_reasoning_comes_first_then_the_answer(server, generation):
    request = await scripted(server, OUTPUT)
    messages = [m async for m in generation.GenerateStream(request)]
    assert "".join(m.reasoning_text for m in messages) == f"\n{THOUGHT}\n"
    assert "".join(m.text for m in messages) == "\n\nHello there!"
    with_reasoning = [i for i, m in enumerate(messages) if m.reasoning_text]
    with_text = [i for i, m in enumerate(messages) if m.text]
    assert len(with_reasoning) > 3  # streamed as it comes, not held to the end
    assert max(with_reasoning) < min(with_text)
    assert not any("think>" in m.text + m.reasoning_text for m in messages)


async def test_output_without_tags_is_all_answer(server, generation):
    response = await generation.Generate(await scripted(server, "Just an answer."))
    assert (response.reasoning_text, response.text) == ("", "Just an answer.")


async def test_text_input_is_not_split(server, generation):
    request = await scripted(server, OUTPUT, text="Hi")
    response = await generation.Generate(request)
    assert response.text == OUTPUT and not response.reasoning_text


def greet_tool() -> common_pb2.Tool:
    tool = common_pb2.Tool(type="function")
    tool.function.name = "greet"
    who = {"who": {"enum": ["you", "them"]}}  # a value a random model finishes at once
    tool.function.parameters = json.dumps(
        {"type": "object", "properties": who, "required": ["who"]}
    )
    return tool


def calls(response) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in response.tool_calls]


CALL = '<tool_call>\n{"name": "greet", "arguments": {"who": "you"}}\n</tool_call>'


async def test_calls_are_read_from_the_answer_alone(server, generation):
    # A call written inside the reasoning is part of the thinking, not a call.
    output = f"<think>Maybe {CALL}? Yes.</think>Calling.{CALL}"
    request = await scripted(server, output)
    request.chat.tools.append(greet_tool())
    response = await generation.Generate(request)
    assert response.reasoning_text == f"Maybe {CALL}? Yes."
    assert response.text == "Calling." and calls(response) == [("greet", {"who": "you"})]
    request = await scripted(server, output)
    request.chat.tools.append(greet_tool())
    messages = [m async for m in generation.GenerateStream(request)]
    assert "".join(m.reasoning_text for m in messages) == f"Maybe {CALL}? Yes."
    assert "".join(m.text for m in messages) == "Calling."
    assert [c.function.name for m in messages for c in m.tool_calls] == ["greet"]


async def test_forced_calls_are_read_under_a_reasoning_parser(generation):
    """The random-weight model's own output, held to the schema (this server's grammar starts
    at the output's first token), is read as the calls."""
    required = common_pb2.ToolChoice(mode=common_pb2.ToolChoice.MODE_REQUIRED)
    request = generation_pb2.GenerateRequest(
        chat=chat(tools=[greet_tool()], tool_choice=required, parallel_tool_calls=False),
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=3),
        stopping=common_pb2.StoppingCriteria(max_tokens=120),
    )
    response = await generation.Generate(request)
    assert response.finish_reason == generation_pb2.FINISH_REASON_EOS
    assert not response.reasoning_text and not response.text
    ((name, arguments),) = calls(response)
    assert name == "greet" and arguments["who"] in ("you", "them")
