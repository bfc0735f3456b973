"""The shapes ``/v1/responses`` answers in, without a server: streams of reasoning, text and
tool calls (which a random-weight model does not produce) read by the OpenAI SDK's own
accumulator, whole responses validated as its types, and input items as chat messages (the
store's bounds: ``test_responses_api_store``)."""

from __future__ import annotations

import json

import openai
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response
from responses_support import sse_events

from llmrpc.clients import FinishReason, ToolCall, Usage
from llmrpc.gateway import responses_api_output as out
from llmrpc.gateway.responses_api_input import ResponsesRequest, input_conversation
from llmrpc.gateway.responses_api_stream import ResponseEvents

CALL = ToolCall("call_7", "get_weather", '{"city": "Paris"}')
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def _scripted_events(request: dict, script) -> str:
    """The stream the gateway writes for a scripted run of deltas (reasoning, text, calls):
    what a model under --reasoning-parser and --tool-call-parser gives, which a
    random-weight model does not."""
    stream = ResponseEvents(out.envelope(ResponsesRequest(**request), "resp_1", "m"))
    chunks = stream.start()
    for kind, value in script:
        chunks += stream.tool_call(value) if kind == "call" else stream.text(value, kind)
    chunks += stream.finish(FinishReason.STOP_TOKEN, out.usage(Usage(9, 7, 0), 3))
    return b"".join(chunks).decode()


def test_reasoning_and_calls_stream_as_the_sdk_accumulates_them():
    texts = [("reasoning", "Let me "), ("reasoning", "think."), ("message", "Checking")]
    script = [*texts, ("message", "."), ("call", CALL)]
    events = sse_events(_scripted_events({"input": "Weather?", "tools": [TOOL]}, script))
    state = ResponseStreamState(input_tools=[TOOL], text_format=openai.omit)
    parsed = [e for event in events for e in state.handle_event(event)]
    final = parsed[-1].response
    assert parsed[-1].type == "response.completed" and final.status == "completed"
    reasoning, message, function_call = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me think."
    assert message.content[0].text == "Checking." and final.output_text == "Checking."
    assert (function_call.name, function_call.call_id) == ("get_weather", "call_7")
    assert json.loads(function_call.arguments) == {"city": "Paris"}
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert final.usage.output_tokens_details.reasoning_tokens == 3


def test_items_from_an_earlier_turn_become_chat_messages():
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    thought = [{"type": "reasoning_text", "text": "Hm."}]
    items = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Go."},
        {"type": "reasoning", "summary": [], "content": thought},
        call,
        {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "1"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "x"}]},
        {"role": "user", "content": "Next."},
    ]
    conversation = input_conversation(ResponsesRequest(input=items))
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for i in (1, 2)
    ]
    assert conversation.messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": "", "reasoning_content": "Hm.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        {"role": "user", "content": "Next."},  # reasoning with no answer after it: dropped
    ]
    assert conversation.origins == ["input[0]", "input[1]", "input[3]", "input[5]", "input[7]"]


def test_an_output_of_nothing_is_an_empty_message():
    events = sse_events(_scripted_events({"input": "Hi"}, []))
    [message] = events[-1].response.output
    assert message.type == "message" and message.content[0].text == ""
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_whole_response_with_reasoning_and_calls_validates_as_the_sdks():
    body = ResponsesRequest(input="Weather?", tools=[TOOL], tool_choice="required")
    output = out.output_items("", "Hm.", [CALL], "completed")
    usage = out.usage(Usage(9, 7, 2), 2)
    response = Response.model_validate(
        out.finished(out.envelope(body, "resp_1", "m"), FinishReason.EOS, output, usage)
    )
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.tool_choice == "required" and response.status == "completed"
    assert out.assistant_message(out.output_items("", "Hm.", [CALL], "completed")) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Hm.",
        "tool_calls": [{"id": "call_7", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    }  # fmt: skip
