"""The body of ``POST /v1/responses`` and its input as chat messages.

Every field OpenAI defines is either honoured or refused with a 400 naming it; a field the
gateway does not know is ignored with a warning, or a 400 under ``--strict-request-fields``
(``request_fields``). The input becomes OpenAI-shaped chat messages
for the gRPC API: ``instructions`` first as a system message, then the stored conversation of
``previous_response_id``, then the input items (developer messages are system messages: chat
templates know no developer role). A reasoning item sent back becomes the
``reasoning_content`` of the assistant message after it; the chat template decides whether the
model sees it (most show it only within the turn in progress, between tool calls).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from llmrpc.gateway.errors import invalid
from llmrpc.gateway.openai_models import Float32, UInt32
from llmrpc.gateway.request_fields import StrictModel

# OpenAI's own bounds on metadata; at most as many tools as the gRPC API takes.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_TOOLS = 128
MAX_ID_CHARS = 256  # previous_response_id, user, safety_identifier, item ids

ShortStr = Annotated[str, Field(max_length=MAX_ID_CHARS)]
MetadataKey = Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)]
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)]


class ContentPart(BaseModel):
    """input_text / output_text / refusal parts; other types are refused when converted."""

    model_config = ConfigDict(extra="allow")  # annotations, logprobs of output_text parts

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: ShortStr | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(StrictModel):
    """A call the model made in an earlier turn (an output item sent back)."""

    type: Literal["function_call"]
    call_id: ShortStr
    name: str
    arguments: str
    id: ShortStr | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    """The caller's result of a function call."""

    type: Literal["function_call_output"]
    call_id: ShortStr
    output: str | list[ContentPart]
    id: ShortStr | None = None
    status: str | None = None


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: ShortStr | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    status: str | None = None


def _item_kind(value: Any) -> str:
    """Which item a value is, by its type (a message may leave it out): one form validated."""
    if isinstance(value, BaseModel):
        return type(value).__name__
    kind = value.get("type", "message") if isinstance(value, dict) else "message"
    return _ITEM_TAGS.get(kind, kind)


# Tags named as the classes: they read as types in error locations, which ``param_names``
# leaves out (``input[0].content``, not ``input[0].message.content``).
_ITEM_TAGS = {
    "message": "MessageItem",
    "function_call": "FunctionCallItem",
    "function_call_output": "FunctionCallOutputItem",
    "reasoning": "ReasoningItem",
}

InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ReasoningItem, Tag("ReasoningItem")],
    Discriminator(_item_kind),
]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """``text.format``: text, json_object, or json_schema (flat: name and schema beside type)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without the knob has


class ResponsesRequest(StrictModel):
    model_config = ConfigDict(populate_by_name=True)

    input: str | list[InputItem]
    instructions: str | None = None
    model: str | None = None
    max_output_tokens: Annotated[UInt32, Field(ge=1)] | None = None
    temperature: Annotated[Float32, Field(ge=0)] | None = None
    top_p: Float32 | None = None
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: ShortStr | None = None
    store: bool = True
    metadata: Metadata | None = None
    user: ShortStr | None = None
    safety_identifier: ShortStr | None = None
    # OpenAI's fields that only their defaults can have here (see ``refuse_unhonoured``).
    background: bool | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    stream_options: dict[str, Any] | None = None
    conversation: Any = None
    prompt: Any = None
    prompt_cache_key: str | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools):
        """Built-in tools (web_search, file_search...) are refused by name, before their
        fields are checked against a function tool's."""
        for index, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind is not None and kind != "function":
                why = f"tools[{index}].type: {kind!r} tools are not supported: function tools only"
                raise PydanticCustomError("unsupported_tool", "{why}", {"why": why})
        return tools


# Field -> (values that change nothing here, why another value cannot be honoured).
_DEFAULTS_ONLY: dict[str, tuple[tuple, str]] = {
    "background": ((None, False), "background mode is not supported: a response is generated "
                   "while its request is open"),
    "truncation": ((None, "disabled"), 'only "disabled" is supported: an input longer than the '
                   "context window is a 400"),
    "include": ((None, []), "no additional output data is available from this server"),
    "reasoning": ((None,), "reasoning options are not supported: the model reasons (or not) "
                  "as it was trained to"),
    "service_tier": ((None, "auto", "default"), 'only "auto" and "default" are supported'),
    "top_logprobs": ((None, 0), "logprobs are not supported on this endpoint; use "
                     "/v1/chat/completions"),
    "max_tool_calls": ((None,), "it bounds built-in tools, which this server does not have"),
    "stream_options": ((None, {}, {"include_obfuscation": False}), "stream obfuscation is not "
                       "supported"),
    "conversation": ((None,), "conversations are not supported; use previous_response_id"),
    "prompt": ((None,), "prompt templates are not supported"),
    "prompt_cache_key": ((None,), "not supported: the server's prefix cache needs no key"),
}  # fmt: skip


def refuse_unhonoured(body: ResponsesRequest) -> None:
    """A 400 for an OpenAI field set to something this server would have to ignore."""
    for name, (defaults, why) in _DEFAULTS_ONLY.items():
        value = getattr(body, name)
        if not any(value == default and type(value) is type(default) for default in defaults):
            raise invalid(name, f"{name}: {why}")


def _part_text(part: ContentPart, param: str) -> str:
    if part.type in ("input_text", "output_text", "text"):
        if part.text is None:
            raise invalid(f"{param}.text", f"{param}.text: a text part needs its text")
        return part.text
    if part.type == "refusal" and part.refusal is not None:
        return part.refusal
    raise invalid(
        f"{param}.type",
        f"{param}.type: content parts of type {part.type!r} are not supported: text only",
    )


def content_text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(_part_text(part, f"{param}[{i}]") for i, part in enumerate(content))


class Conversation:
    """Chat messages and, for each, the request parameter it came from (so a gRPC error
    about ``chat.messages[3]`` names ``input[1]``)."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.origins: list[str] = []
        self._reasoning: str | None = None  # a reasoning item's, for the next assistant message

    def add(self, message: dict, origin: str) -> None:
        if self._reasoning is not None and message["role"] == "assistant":
            message = {**message, "reasoning_content": self._reasoning}
        self._reasoning = None  # reasoning belongs to the answer right after it, if any
        self.messages.append(message)
        self.origins.append(origin)

    def add_reasoning(self, text: str) -> None:
        self._reasoning = text

    def add_call(self, call: dict, origin: str) -> None:
        """A function call joins the assistant message before it, as chat's tool_calls do.
        Messages are replaced, never changed: stored conversations share them."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning is not None:
            self.add({"role": "assistant", "content": ""}, origin)
            last = self.messages[-1]
        self.messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}


def _add_item(conversation: Conversation, item, param: str) -> None:
    if isinstance(item, MessageItem):
        role = "system" if item.role == "developer" else item.role
        text = content_text(item.content, f"{param}.content")
        conversation.add({"role": role, "content": text}, param)
    elif isinstance(item, FunctionCallItem):
        function = {"name": item.name, "arguments": item.arguments}
        call = {"id": item.call_id, "type": "function", "function": function}
        conversation.add_call(call, param)
    elif isinstance(item, FunctionCallOutputItem):
        text = content_text(item.output, f"{param}.output")
        conversation.add({"role": "tool", "tool_call_id": item.call_id, "content": text}, param)
    elif isinstance(item, ReasoningItem):
        conversation.add_reasoning(_reasoning_text(item))


def _reasoning_text(item: ReasoningItem) -> str:
    """The reasoning's text, else its summary's (what OpenAI's reasoning models return)."""
    parts = item.content or item.summary
    return "".join(str(part.get("text", "")) for part in parts)


def input_conversation(body: ResponsesRequest) -> Conversation:
    """This request's own input (not its instructions) as chat messages."""
    conversation = Conversation()
    if isinstance(body.input, str):
        conversation.add({"role": "user", "content": body.input}, "input")
        return conversation
    for index, item in enumerate(body.input):
        _add_item(conversation, item, f"input[{index}]")
    return conversation


def chat_tools(tools: list[FunctionTool] | None) -> list[dict] | None:
    """Responses function tools in chat's shape: {"type": "function", "function": {...}}."""
    if not tools:
        return None
    return [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        for tool in tools
    ]


def chat_tool_choice(choice: str | NamedTool | None) -> str | dict | None:
    if isinstance(choice, NamedTool):
        return {"type": "function", "function": {"name": choice.name}}
    return choice
