"""Chat rendering through the gateway: the request's template and variables, the gateway's
``--chat-template`` and ``--chat-template-content-format``, ``continue_final_message``, and
tools shown to the template; checked on the rendered prompt (``/tokenize`` then detokenize)."""

from __future__ import annotations

import pytest
from envoy_support import tiny_engine_config
from gateway_support import post, running_gateway

from llmrpc.server.settings import FrontendConfig

USER = [{"role": "user", "content": "Hi"}]
PARTS_TEMPLATE = (
    "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"  # noqa: E501
)
STRING_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"


@pytest.fixture(scope="module")
def replica(server_loop, tiny_llama_dir):
    """A replica that accepts chat templates from requests (--trust-request-chat-template)."""
    frontend = FrontendConfig(host="127.0.0.1", grpc_port=0, trust_request_chat_template=True)
    started = server_loop.start_replica(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def render(grpc_client):
    """``render(gateway, body)``: the prompt text the gateway's replica renders for ``body``."""

    def render(gateway, body: dict) -> str:
        reply = post(gateway, "/tokenize", body)
        assert reply.status_code == 200, reply.text
        return grpc_client.detokenize(reply.json()["tokens"], skip_special_tokens=False)

    return render


def test_continue_final_message_leaves_the_answer_open(gateway, render):
    messages = [*USER, {"role": "assistant", "content": "The capital is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert render(gateway, body).endswith("<|im_start|>assistant\nThe capital is")
    closed = render(gateway, {"messages": messages, "add_generation_prompt": False})
    assert closed.endswith("The capital is<|im_end|>\n")


def test_request_template_and_its_variables(gateway, render):
    template = STRING_TEMPLATE + "{{ closing }}"
    body = {"messages": USER, "chat_template": template, "chat_template_kwargs": {"closing": "!"}}
    assert render(gateway, body) == "<Hi>!"
    completion = post(gateway, "/v1/chat/completions", {**body, "max_tokens": 2}).json()
    assert completion["usage"]["prompt_tokens"] == len(
        post(gateway, "/tokenize", body).json()["tokens"]
    )
    reserved = {**body, "chat_template_kwargs": {"add_generation_prompt": False}}
    reply = post(gateway, "/v1/chat/completions", reserved)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "chat_template_kwargs"


def test_content_parts_reach_templates_that_iterate_over_them(gateway, render):
    two_parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert render(gateway, {"messages": USER, "chat_template": PARTS_TEMPLATE}) == "[Hi]"
    assert render(gateway, {"messages": two_parts, "chat_template": STRING_TEMPLATE}) == "<a\nb>"


def test_tools_are_shown_to_the_template_with_tool_choice_none(gateway, grpc_client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    template = "{{ tools[0]['function']['name'] }}"
    body = {"messages": USER, "tools": tools, "tool_choice": "none", "chat_template": template}
    reply = post(gateway, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    rendered = grpc_client.tokenize("get_weather", add_special_tokens=False)
    assert reply.json()["usage"]["prompt_tokens"] == rendered.count


def test_gateway_chat_template_flag(server_loop, replica, render):
    with running_gateway(
        server_loop, [replica.address], api={"chat_template": STRING_TEMPLATE}
    ) as gateway:
        assert render(gateway, {"messages": USER}) == "<Hi>"
        own = render(gateway, {"messages": USER, "chat_template": "[{{ messages[0]['content'] }}]"})
        assert own == "[Hi]"  # the request's wins


def test_content_format_flag(server_loop, replica, render):
    template = "{{ messages[0]['content'] }}"
    api = {"chat_template": template, "chat_template_content_format": "openai"}
    with running_gateway(server_loop, [replica.address], api=api) as gateway:
        assert render(gateway, {"messages": USER}) == "[{'type': 'text', 'text': 'Hi'}]"
    api = {"chat_template": PARTS_TEMPLATE, "chat_template_content_format": "string"}
    with running_gateway(server_loop, [replica.address], api=api) as gateway:
        # The template iterates over a string's characters, which have no 'text'.
        assert render(gateway, {"messages": USER}) == "[][]"
