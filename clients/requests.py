"""Request building shared by ``Client`` and ``AsyncClient``: keyword arguments to v1 protos.

Only the parameters a caller sets reach the request; the rest stay unset, so the server's
published defaults apply (proto3 ``optional`` tells "unset" from zero).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from google.protobuf import json_format

from llmrpc.v1 import common_pb2, generation_pb2, tokenization_pb2

# A chat message in the OpenAI shape: {"role": ..., "content": ...}, and on an assistant message
# "tool_calls" ([{"id", "type", "function": {"name", "arguments"}}]) and "reasoning_content", on a
# tool message "tool_call_id", on any "name".
ChatMessages = Sequence[Mapping[str, Any]]
Prompt = str | Sequence[int]


def _in(part: str):
    """A parameter held by this part of GenerateRequest ("": the request itself)."""
    return field(default=None, metadata={"part": part})


@dataclass(frozen=True)
class GenerateParams:
    """The keyword arguments of ``generate``/``stream``/``chat``; None means the server default.

    The names are the proto fields' (see common.proto and generation.proto), except
    ``time_limit``, in seconds (the proto carries milliseconds). ``stop`` takes one string or
    several; ``logit_bias`` maps token ids to biases.
    """

    temperature: float | None = _in("sampling")
    top_p: float | None = _in("sampling")
    top_k: int | None = _in("sampling")
    min_p: float | None = _in("sampling")
    seed: int | None = _in("sampling")
    repetition_penalty: float | None = _in("sampling")
    presence_penalty: float | None = _in("sampling")
    frequency_penalty: float | None = _in("sampling")
    logit_bias: Mapping[int, float] | None = _in("sampling")
    allowed_token_ids: Sequence[int] | None = _in("sampling")
    bad_words: Sequence[str] | None = _in("sampling")
    n: int | None = _in("sampling")
    max_tokens: int | None = _in("stopping")
    min_tokens: int | None = _in("stopping")
    stop: Sequence[str] | str | None = _in("stopping")
    stop_token_ids: Sequence[int] | None = _in("stopping")
    ignore_eos: bool | None = _in("stopping")
    include_stop_str_in_output: bool | None = _in("stopping")
    time_limit: float | None = None  # seconds; set as stopping.time_limit_ms
    skip_special_tokens: bool | None = _in("output")
    spaces_between_special_tokens: bool | None = _in("output")
    logprobs: int | None = _in("output")
    prompt_logprobs: int | None = _in("output")
    add_special_tokens: bool | None = _in("")
    truncate_prompt_tokens: int | None = _in("")
    priority: int | None = _in("")
    lora: str | None = _in("")  # a loaded LoRA adapter's name; None: the base model
    # A StructuredOutput as a dict in its JSON form: {"json_schema": {...}}, {"regex": "..."},
    # {"choice": {"choices": [...]}}, {"json_object": True}, {"grammar": "..."}...
    structured_output: Mapping[str, object] | None = None


@dataclass(frozen=True)
class ChatOptions:
    """How chat messages are rendered (the fields of the proto's ``Chat`` besides messages);
    None means the server default."""

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None  # a Jinja template instead of the server's
    chat_template_kwargs: Mapping[str, object] | None = None  # extra template variables
    content_format: str | None = None  # "string" or "openai"; None: detected from the template
    # Tools in OpenAI's shape: [{"type": "function", "function": {"name", "description",
    # "parameters", "strict"}}]; None: no tools.
    tools: Sequence[Mapping[str, Any]] | None = None
    # "none", "auto", "required", or one function: {"type": "function", "function": {"name":
    # ...}} (or the Responses API's {"type": "function", "name": ...}); None: auto with tools.
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call per output


_CONTENT_FORMATS = {
    "string": common_pb2.Chat.CONTENT_FORMAT_STRING,
    "openai": common_pb2.Chat.CONTENT_FORMAT_OPENAI,
}
_TOOL_CHOICE_MODES = {
    "none": common_pb2.ToolChoice.MODE_NONE,
    "auto": common_pb2.ToolChoice.MODE_AUTO,
    "required": common_pb2.ToolChoice.MODE_REQUIRED,
}


def _tool_call_proto(call: Mapping[str, Any], index: int) -> common_pb2.ToolCall:
    function = call.get("function") or {}
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):  # a dict, as some clients send it
        arguments = json.dumps(arguments, ensure_ascii=False)
    return common_pb2.ToolCall(
        id=call.get("id") or "",
        type=call.get("type") or "function",
        function=common_pb2.FunctionCall(name=function.get("name") or "", arguments=arguments),
        index=index,
    )


def message_proto(message: Mapping[str, Any]) -> common_pb2.ChatMessage:
    """One OpenAI-shaped chat message (see ``ChatMessages``) as the proto."""
    proto = common_pb2.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_call_id=message.get("tool_call_id") or "",
        name=message.get("name") or "",
        tool_calls=[_tool_call_proto(c, i) for i, c in enumerate(message.get("tool_calls") or ())],
    )
    if message.get("reasoning_content") is not None:
        proto.reasoning_content = message["reasoning_content"]
    return proto


def tool_proto(tool: Mapping[str, Any]) -> common_pb2.Tool:
    function = tool.get("function") or {}
    proto = common_pb2.Tool(type=tool.get("type") or "function")
    proto.function.name = function.get("name") or ""
    proto.function.description = function.get("description") or ""
    if function.get("parameters") is not None:
        proto.function.parameters = _json_text(function["parameters"])
    if function.get("strict") is not None:
        proto.function.strict = function["strict"]
    return proto


def tool_choice_proto(choice: str | Mapping[str, Any]) -> common_pb2.ToolChoice:
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be none, auto, required or a function: {choice!r}")
        return common_pb2.ToolChoice(mode=_TOOL_CHOICE_MODES[choice])
    name = (choice.get("function") or {}).get("name", choice.get("name"))
    if not isinstance(name, str):
        raise ValueError(f"a function tool_choice needs the function's name: {choice!r}")
    return common_pb2.ToolChoice(function_name=name)


def chat_proto(messages: ChatMessages, options: ChatOptions | None = None) -> common_pb2.Chat:
    chat = common_pb2.Chat(messages=[message_proto(m) for m in messages])
    options = options or ChatOptions()
    for name in (
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "parallel_tool_calls",
    ):
        if getattr(options, name) is not None:
            setattr(chat, name, getattr(options, name))
    if options.chat_template_kwargs is not None:
        chat.chat_template_kwargs.update(options.chat_template_kwargs)
    if options.content_format is not None:
        chat.content_format = _CONTENT_FORMATS[options.content_format]
    chat.tools.extend(tool_proto(tool) for tool in options.tools or ())
    if options.tool_choice is not None:
        chat.tool_choice.CopyFrom(tool_choice_proto(options.tool_choice))
    return chat


def _set_input(request, prompt: Prompt | None, messages: ChatMessages | None, chat_options) -> None:
    if messages is not None:
        request.chat.CopyFrom(chat_proto(messages, chat_options))
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    else:
        raise TypeError("give a prompt (text or token ids) or chat messages")


def _set_field(message, name: str, value) -> None:
    field = message.DESCRIPTOR.fields_by_name[name]
    if not field.is_repeated:
        setattr(message, name, value)
    elif field.message_type is not None:  # a map
        getattr(message, name).update(value)
    else:
        getattr(message, name).extend([value] if isinstance(value, str) else value)


def _json_text(value: object) -> str:
    """A JSON schema given as a dict (or already as text) in the JSON text a proto carries."""
    return value if isinstance(value, str) else json.dumps(value)


def _set_params(request: generation_pb2.GenerateRequest, params: GenerateParams) -> None:
    for param in fields(params):
        value, part = getattr(params, param.name), param.metadata.get("part")
        if value is not None and part is not None:
            _set_field(getattr(request, part) if part else request, param.name, value)
    if params.time_limit is not None:
        request.stopping.time_limit_ms = round(params.time_limit * 1000)
    if params.structured_output is not None:
        structured = dict(params.structured_output)
        if "json_schema" in structured:  # JSON text on the wire: it keeps the key order
            structured["json_schema"] = _json_text(structured["json_schema"])
        json_format.ParseDict(structured, request.structured_output)


def generate_request(
    prompt: Prompt | None = None,
    *,
    messages: ChatMessages | None = None,
    model: str = "",
    request_id: str | None = None,
    chat_options: ChatOptions | None = None,
    **params,
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from a text or token-id prompt, or chat messages, and parameters.

    Unknown parameter names raise ``TypeError``, as a misspelled keyword argument would.
    """
    request = generation_pb2.GenerateRequest(model=model, request_id=request_id or "")
    _set_input(request, prompt, messages, chat_options)
    _set_params(request, GenerateParams(**params))
    return request


def tokenize_request(
    text: str | None = None,
    *,
    messages: ChatMessages | None = None,
    model: str = "",
    add_special_tokens: bool | None = None,
    chat_options: ChatOptions | None = None,
) -> tokenization_pb2.TokenizeRequest:
    request = tokenization_pb2.TokenizeRequest(model=model)
    if messages is not None:
        request.chat.CopyFrom(chat_proto(messages, chat_options))
    elif text is not None:
        request.text = text
    else:
        raise TypeError("give text or chat messages to tokenize")
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def detokenize_request(
    token_ids: Sequence[int], *, model: str = "", skip_special_tokens: bool | None = None
) -> tokenization_pb2.DetokenizeRequest:
    request = tokenization_pb2.DetokenizeRequest(model=model, token_ids=list(token_ids))
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    return request
