"""Request bodies of the OpenAI API (and vLLM's extensions of it) as pydantic models.

Responses are built as plain dicts in ``responses``: they are written once per streamed delta,
where a model's validation would cost more than the JSON itself. Unknown request fields are
ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NonNegative = Annotated[int, Field(ge=0)]
# The gRPC API's seeds are uint32 (JSON users get numbers, not strings).
Seed = Annotated[int, Field(ge=0, lt=2**32)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Parameters shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: NonNegative | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: NonNegative | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[NonNegative] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    priority: int | None = None
    allowed_token_ids: list[NonNegative] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: NonNegative | None = None
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: NonNegative | None = None
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
    top_logprobs: NonNegative | None = None
    max_completion_tokens: NonNegative | None = None
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


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[NonNegative]
