"""Request bodies of the OpenAI API (and vLLM's extensions of it) as pydantic models.

Responses are built as plain dicts in ``responses``: they are written once per streamed delta,
where a model's validation would cost more than the JSON itself. Unknown request fields are
ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

# The gRPC API's number types bound what a request can carry (a larger integer cannot be put in
# the message; a float beyond float32 would arrive as infinity): a 400 naming the parameter here.
UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
UInt32 = Annotated[int, Field(ge=0, le=UINT32_MAX)]
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
Float32 = Annotated[float, Field(allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
Seed = UInt32  # JSON users get numbers, not strings


def _prompt_form(value) -> str:
    """Which form a prompt is in, told by its first element, so one form alone is validated:
    trying each in turn would cost a pass (and an error per element) for each form."""
    if isinstance(value, str):
        return "str"
    first = value[0] if isinstance(value, list) and value else None
    if isinstance(first, list):
        return "list[list[int]]"
    return "list[int]" if isinstance(first, int) else "list[str]"


# Text, texts, token ids, or lists of token ids. The tags read as types, so error locations
# (``prompt.list[int].0``) come out as ``prompt[0]`` (``param_names``).
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[UInt32], Tag("list[int]")]
    | Annotated[list[list[UInt32]], Tag("list[list[int]]")],
    Discriminator(_prompt_form),
]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Parameters shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Annotated[UInt32, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: UInt32 | None = None
    temperature: Annotated[Float32, Field(ge=0)] | None = None
    top_p: Float32 | None = None
    presence_penalty: Float32 | None = None
    frequency_penalty: Float32 | None = None
    logit_bias: dict[str, Float32] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Int32 | None = None
    min_p: Float32 | None = None
    repetition_penalty: Float32 | None = None
    min_tokens: UInt32 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[UInt32] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[UInt32, Field(ge=1)] | None = None
    priority: Int32 | None = None
    allowed_token_ids: list[UInt32] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: UInt32 | None = None
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool = False
    logprobs: UInt32 | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id...

    role: str
    content: str | list[ContentPart] | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: UInt32 | None = None
    max_completion_tokens: UInt32 | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeCompletion(BaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _tokenize_form(value: Any) -> str:
    if isinstance(value, BaseModel):
        return type(value).__name__
    chat = isinstance(value, dict) and "messages" in value
    return "TokenizeChat" if chat else "TokenizeCompletion"


# /tokenize takes messages or a prompt; an error is about the form the body has, not about the
# other one (a bad prompt is not "messages: Field required"). Tags named as the classes read as
# types in error locations, which ``param_names`` leaves out.
TokenizeBody = Annotated[
    Annotated[TokenizeChat, Tag("TokenizeChat")]
    | Annotated[TokenizeCompletion, Tag("TokenizeCompletion")],
    Discriminator(_tokenize_form),
]


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[UInt32]
