"""``/v1/responses`` through the official OpenAI SDK, against the real gateway in front of a real
gRPC replica of the tiny model: whole and streamed responses equal to the gRPC API's chat answer
for the same messages, conversations continued with previous_response_id, store false, and the
400s for what the server cannot honour."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import in_process_gateway
from engine_pace import num_live_requests
from envoy_support import Replica, ServerLoop, wait_for
from gateway_support import RunningGateway
from openai.types.responses import Response
from responses_support import sse_events

from llmrpc.clients import FinishReason

GREEDY = {"model": "", "temperature": 0.0, "max_output_tokens": 6}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def gateway(server_loop: ServerLoop, replica: Replica) -> Iterator[RunningGateway]:
    yield from in_process_gateway(server_loop, replica)


def direct_chat(grpc_client, messages):
    return grpc_client.chat(messages, temperature=0.0, max_tokens=6)


def prompt_tokens(grpc_client, messages) -> int:
    return grpc_client.tokenize(messages=messages).count


def test_a_response_is_the_chat_answer_to_its_input(sdk, grpc_client):
    direct = direct_chat(grpc_client, [{"role": "user", "content": QUESTION}])
    response = sdk.responses.create(input=QUESTION, **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == direct.text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.id.startswith("msg_")
    assert response.usage.input_tokens == direct.usage.prompt_tokens
    assert response.usage.output_tokens == direct.usage.completion_tokens == 6
    assert response.usage.total_tokens == direct.usage.prompt_tokens + 6
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.usage.input_tokens_details.cached_tokens >= 0
    assert direct.finish_reason is FinishReason.LENGTH  # random weights: no EOS this soon
    assert response.status == "incomplete" and message.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.temperature, response.max_output_tokens, response.store) == (0.0, 6, True)


def test_instructions_and_message_items_become_the_chat(sdk, grpc_client):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": f"One\n{QUESTION}"},
    ]
    items = [
        {"role": "user", "content": "Hi."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},  # noqa: E501
        {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": [{"type": "input_text", "text": "One"}, {"type": "input_text", "text": QUESTION}]},  # noqa: E501
    ]  # fmt: skip
    response = sdk.responses.create(input=items, instructions="Answer briefly.", **GREEDY)
    direct = direct_chat(grpc_client, messages)
    assert response.output_text == direct.text
    assert response.usage.input_tokens == prompt_tokens(grpc_client, messages)
    assert response.instructions == "Answer briefly."


def test_previous_response_id_continues_the_conversation(sdk, grpc_client):
    first = sdk.responses.create(input=QUESTION, instructions="Answer briefly.", **GREEDY)
    second = sdk.responses.create(
        input="And of Spain?", previous_response_id=first.id, metadata={"turn": "2"}, **GREEDY
    )
    # The first turn and its answer come before the new input; its instructions do not.
    conversation = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Spain?"},
    ]
    assert second.usage.input_tokens == prompt_tokens(grpc_client, conversation)
    assert second.output_text == direct_chat(grpc_client, conversation).text
    assert second.previous_response_id == first.id and second.metadata == {"turn": "2"}
    third = sdk.responses.create(input="And Italy?", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_a_stored_response_can_be_retrieved_and_deleted(sdk):
    response = sdk.responses.create(input=QUESTION, **GREEDY)
    assert sdk.responses.retrieve(response.id).model_dump() == response.model_dump()
    sdk.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)


def test_store_false_keeps_nothing(sdk):
    response = sdk.responses.create(input=QUESTION, store=False, **GREEDY)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(input="More", previous_response_id=response.id, **GREEDY)
    assert caught.value.body["param"] == "previous_response_id"
    assert caught.value.body["code"] == "previous_response_not_found"


def _check_sequence(events) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut short by max_output_tokens
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}


def test_a_streamed_response_sends_openais_events(sdk):
    whole = sdk.responses.create(input=QUESTION, **GREEDY)
    events = list(sdk.responses.create(input=QUESTION, stream=True, **GREEDY))
    _check_sequence(events)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == whole.output_text
    assert final.usage.model_dump() == whole.usage.model_dump()
    item_id = events[2].item.id
    assert all(getattr(e, "item_id", item_id) == item_id for e in events[2:-1])
    assert sdk.responses.retrieve(final.id).output_text == whole.output_text


def test_the_stream_helper_parses_every_event(sdk):  # the stream ends incomplete: no final
    with sdk.responses.stream(input=QUESTION, **GREEDY) as stream:
        events = list(stream)
    _check_sequence(events)
    text_events = [e for e in events if e.type == "response.output_text.delta"]
    assert text_events[-1].snapshot == events[-4].text  # the helper accumulated the deltas


def test_every_answer_validates_as_the_sdks_types(gateway):
    body = {"input": QUESTION, "instructions": "Answer briefly.", **GREEDY}
    reply = httpx.post(gateway.url + "/v1/responses", json=body, timeout=60)
    Response.model_validate(reply.json())
    reply = httpx.post(gateway.url + "/v1/responses", json={**body, "stream": True}, timeout=60)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    _check_sequence(sse_events(reply.text))


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"temperature": -1}, "temperature"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),  # noqa: E501
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_it(gateway, extra, param):
    body = {"input": QUESTION, **GREEDY, **extra}
    reply = httpx.post(gateway.url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_server_errors_name_the_responses_parameter(sdk):
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(input=QUESTION, **{**GREEDY, "model": "no-such-model"})
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(input="word " * 5000, **GREEDY)
    assert caught.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(input=QUESTION, stream=True, **{**GREEDY, "top_p": 7.0})
    assert caught.value.body["param"] == "top_p"


def _read_until(sock: socket.socket, marker: bytes) -> None:
    sock.settimeout(15.0)
    received = b""
    while marker not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk


@pytest.mark.parametrize("stream", [False, True])
def test_hanging_up_ends_the_request_in_the_engine(gateway, slow_engine, caplog, stream):
    caplog.set_level(logging.WARNING)
    body = {"input": QUESTION, "max_output_tokens": 400, "stream": stream}
    content = json.dumps(body).encode()
    head = (
        "POST /v1/responses HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(content)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", gateway.server.port)) as sock:
        sock.sendall(head.encode() + content)
        wait_for(
            lambda: num_live_requests(slow_engine) >= 1,
            "the request to reach the engine",
            timeout=15.0,
        )
        if stream:
            _read_until(sock, b"event: response.output_text.delta")
    wait_for(
        lambda: num_live_requests(slow_engine) == 0,
        "the engine to drop the abandoned request",
        timeout=15.0,
    )
    time.sleep(0.3)  # what the gateway logs after the abort, it logs by now
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not problems, [r.getMessage() + (r.exc_text or "") for r in problems]


CITY = {"type": "string", "enum": ["Paris", "Rome"]}
CITY_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}


def test_text_format_json_schema_holds_the_output(sdk):
    response = sdk.responses.create(input=QUESTION, text=CITY_FORMAT, **GREEDY)
    assert response.status == "completed" and response.completed_at is not None
    assert json.loads(response.output_text) in CITY["enum"]
    assert response.text.format.type == "json_schema" and response.text.format.name == "city"
    # Completed, so the stream helper has a final response to give.
    with sdk.responses.stream(input=QUESTION, text=CITY_FORMAT, **GREEDY) as stream:
        final = stream.get_final_response()
    assert final.output_text == response.output_text and final.status == "completed"


def test_text_format_json_object_starts_an_object(sdk):
    free = sdk.responses.create(input=QUESTION, **GREEDY).output_text
    text = {"format": {"type": "json_object"}}
    held = sdk.responses.create(input=QUESTION, text=text, **GREEDY).output_text
    assert held.startswith("{") and not free.startswith("{")


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({**CITY_FORMAT["format"], "schema": {"type": "nonsense"}}, "text.format.schema"),
        ({"type": "json_schema", "name": "x"}, "text.format.schema"),
        ({"type": "grammar"}, "text.format.type"),
    ],
)
def test_a_bad_text_format_is_a_400_naming_it(gateway, fmt, param):
    body = {"input": QUESTION, **GREEDY, "text": {"format": fmt}}
    reply = httpx.post(gateway.url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
