"""Rendering a ``Chat`` into prompt text with a chat template (the model's, or the request's).

The request's options reach the template as Transformers' ``apply_chat_template`` takes them:
``add_generation_prompt`` (default true, false when continuing), ``continue_final_message``,
``tools`` (OpenAI-shaped dicts), extra template variables (``chat_template_kwargs``, e.g.
``enable_thinking``), messages with their tool calls, tool results and reasoning, and
the content format: a string, or OpenAI's list of text parts for templates that iterate over a
message's content (detected from the template unless the request says). Templates run in
Jinja's sandbox, as Transformers renders them.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable

from google.protobuf import json_format
from jinja2 import TemplateError

from llmrpc.server.errors import InvalidArgument
from llmrpc.server.tool_calling import template_tool_calls, template_tools
from llmrpc.v1 import common_pb2

# apply_chat_template's own parameters: not template variables.
_RESERVED = {"conversation", "add_generation_prompt", "continue_final_message", "tokenize"}
_RESERVED |= {"chat_template", "return_dict", "return_tensors", "tokenizer_kwargs"}
# A template looping over a message's content: `for part in message['content']` or `.content`.
_ITERATES_CONTENT = re.compile(r"\bfor\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content)")

# Bounds on rendering a template a request brought (--trust-request-chat-template).
REQUEST_TEMPLATE_TIME_S = 2.0
REQUEST_TEMPLATE_MAX_CHARS = 4 * 2**20


class _TooSlow(BaseException):
    """A request's chat template ran past REQUEST_TEMPLATE_TIME_S. A BaseException, so that no
    ``except Exception`` in the code it interrupts can swallow it (the trace would be gone)."""


def check_request_template(chat: common_pb2.Chat, trusted: bool) -> None:
    """A request may bring its own chat template only with --trust-request-chat-template: a
    template is a program, and rendering it costs the server what the template asks."""
    if chat.HasField("chat_template") and not trusted:
        raise InvalidArgument(
            "chat.chat_template",
            "this server does not accept chat templates from requests (start it with "
            "--trust-request-chat-template to allow them); leave it unset for the model's",
        )


def _bounded(render: Callable[[], str]) -> str:
    """``render()`` stopped once it runs past the time bound: a trace function on this thread
    checks the clock at every line of Python (templates compile to Python) and raises."""
    deadline = time.monotonic() + REQUEST_TEMPLATE_TIME_S

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise _TooSlow
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        text = render()
    finally:
        sys.settrace(previous)
    if len(text) > REQUEST_TEMPLATE_MAX_CHARS:
        raise InvalidArgument(
            "chat.chat_template",
            f"the template rendered {len(text)} characters; at most "
            f"{REQUEST_TEMPLATE_MAX_CHARS} are accepted",
        )
    return text


def _template(chat: common_pb2.Chat, tokenizer, has_chat_template: bool) -> str | None:
    if chat.HasField("chat_template"):
        return chat.chat_template
    if not has_chat_template:
        raise InvalidArgument(
            "chat",
            "the model's tokenizer has no chat template: serve it with --chat-template, or send "
            "a plain prompt instead of chat messages",
        )
    return None


def _uses_parts(chat: common_pb2.Chat, template: str) -> bool:
    if chat.content_format == common_pb2.Chat.CONTENT_FORMAT_OPENAI:
        return True
    if chat.content_format == common_pb2.Chat.CONTENT_FORMAT_STRING:
        return False
    return bool(_ITERATES_CONTENT.search(template))


def _check_roles(message: common_pb2.ChatMessage, index: int) -> None:
    path = f"chat.messages[{index}]"
    if message.tool_calls and message.role != "assistant":
        raise InvalidArgument(f"{path}.tool_calls", "only assistant messages make tool calls")
    if message.tool_call_id and message.role != "tool":
        raise InvalidArgument(f"{path}.tool_call_id", "only tool messages answer a tool call")


def _message(message: common_pb2.ChatMessage, index: int, as_parts: bool) -> dict:
    """One message as templates read it: OpenAI's shape, with a call's arguments as a dict and
    the reasoning under both names templates use (as vLLM gives them)."""
    _check_roles(message, index)
    content: str | list = message.content
    if as_parts:
        content = [{"type": "text", "text": message.content}]
        if message.tool_calls and not message.content:
            content = []  # calls alone: no empty text part
    rendered: dict = {"role": message.role, "content": content}
    if message.tool_calls:
        rendered["tool_calls"] = template_tool_calls(message)
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name:
        rendered["name"] = message.name
    if message.HasField("reasoning_content"):
        rendered["reasoning_content"] = rendered["reasoning"] = message.reasoning_content
    return rendered


def _messages(chat: common_pb2.Chat, as_parts: bool) -> list[dict]:
    if not chat.messages:
        raise InvalidArgument("chat.messages", "must hold at least one message")
    return [_message(m, i, as_parts) for i, m in enumerate(chat.messages)]


def _template_kwargs(chat: common_pb2.Chat) -> dict:
    kwargs = {}
    if chat.HasField("chat_template_kwargs"):
        kwargs = json_format.MessageToDict(chat.chat_template_kwargs)
    clashing = sorted(_RESERVED & kwargs.keys())
    if clashing:
        raise InvalidArgument(
            "chat.chat_template_kwargs", f"{', '.join(clashing)} cannot be set here"
        )
    if chat.tools:
        if "tools" in kwargs:
            raise InvalidArgument(
                "chat.chat_template_kwargs", "tools cannot be set here as well as in chat.tools"
            )
        kwargs["tools"] = template_tools(chat)
    return kwargs


def _generation_flags(chat: common_pb2.Chat) -> tuple[bool, bool]:
    continue_final = chat.continue_final_message
    add_generation_prompt = not continue_final
    if chat.HasField("add_generation_prompt"):
        add_generation_prompt = chat.add_generation_prompt
    if continue_final and add_generation_prompt:
        raise InvalidArgument(
            "chat.continue_final_message", "cannot be combined with add_generation_prompt true"
        )
    return add_generation_prompt, continue_final


def render_chat(chat: common_pb2.Chat, tokenizer, has_chat_template: bool) -> str:
    """The prompt text of ``chat``; InvalidArgument naming the field for what cannot render."""
    template = _template(chat, tokenizer, has_chat_template)
    messages = _messages(chat, _uses_parts(chat, template or tokenizer.chat_template or ""))
    add_generation_prompt, continue_final = _generation_flags(chat)
    kwargs = _template_kwargs(chat)

    def render() -> str:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            tokenize=False,
            **kwargs,
        )

    try:
        return render() if template is None else _bounded(render)
    except _TooSlow:
        raise InvalidArgument(
            "chat.chat_template",
            f"the template ran longer than {REQUEST_TEMPLATE_TIME_S:g} s and was stopped",
        ) from None
    except TemplateError as error:  # e.g. "roles must alternate user/assistant"
        raise InvalidArgument("chat", f"the chat template rejected the messages: {error}") from None
    except ValueError as error:  # e.g. continuing a final message the template does not end
        raise InvalidArgument("chat", str(error)) from None
