"""Request bodies of the OpenAI API (and vLLM's extensions of it) as pydantic models.

Responses are built as plain dicts in ``responses``: they are written once per streamed delta,
where a model's validation would cost more than the JSON itself. Every request field OpenAI or
vLLM defines that the gateway knows is declared: honoured, or refused with a 400 saying why when
set to a value that would change anything. Fields it does not know are ignored with a warning,
as vLLM ignores them, or a 400 naming them under ``--strict-request-fields`` (``request_fields``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
)
from pydantic_core import PydanticCustomError

from llmrpc.gateway.request_fields import StrictModel
from llmrpc.gateway.structured_output import StructuredFields

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


def refused(reason: str, *accepted: Any) -> AfterValidator:
    """A declared field this server does not support: unset (None) and ``accepted`` values are
    fine (they change nothing); any other value is a 400 giving ``reason``."""

    def check(value: Any) -> Any:
        if value is not None and value not in accepted:
            raise PydanticCustomError("unsupported", reason)
        return value

    return AfterValidator(check)


def _nothing(value: Any) -> bool:
    return value is None or value == [] or value == {}


def empty_only(reason: str) -> AfterValidator:
    """Like ``refused``, for fields whose empty values ([] or {}) are fine too."""

    def check(value: Any) -> Any:
        if not _nothing(value):
            raise PydanticCustomError("unsupported", reason)
        return value

    return AfterValidator(check)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # OpenAI pads streamed chunks against size side channels; chunks here are not padded.
    include_obfuscation: Annotated[
        bool | None, refused("stream obfuscation is not supported: chunks are not padded", False)
    ] = None


MAX_METADATA_PAIRS = 16
MAX_ID_CHARS = 256  # user, safety_identifier, prompt_cache_key
ShortStr = Annotated[str, Field(max_length=MAX_ID_CHARS)]
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=MAX_METADATA_PAIRS),
]

_TIERS = ("auto", "default")
_BEAM = "beam search is not supported: sample n outputs instead"
_MULTIMODAL = "multimodal inputs are not supported by this server"
_NO_STORE = "this server stores no completions (store: false)"
_KV_TRANSFER = "disaggregated serving (KV transfer) is not supported by this server"


class SamplingFields(StrictModel, StructuredFields):
    """Parameters shared by completions and chat completions: OpenAI's and vLLM's, each one
    honoured, or refused by a 400 saying why when set to a value that would change anything.
    Unknown parameters are a 400 too."""

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
    # Labels for the caller's own bookkeeping (OpenAI's abuse monitoring, stored completions):
    # accepted within bounds; they change nothing in the output.
    user: ShortStr | None = None
    safety_identifier: ShortStr | None = None
    metadata: Metadata | None = None
    store: Annotated[bool | None, refused(_NO_STORE, False)] = None
    service_tier: Annotated[
        str | None,
        refused(
            "this server has one service tier (auto, default); see priority", "auto", "default"
        ),
    ] = None
    # vLLM's extensions
    top_k: Int32 | None = None
    min_p: Float32 | None = None
    repetition_penalty: Float32 | None = None
    min_tokens: UInt32 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[UInt32] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[UInt32, Field(ge=1)] | None = None
    priority: Int32 | None = None
    allowed_token_ids: list[UInt32] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: UInt32 | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: Annotated[
        str | None, refused("send the request id in the X-Request-Id header instead")
    ] = None
    use_beam_search: Annotated[bool | None, refused(_BEAM, False)] = None
    length_penalty: Annotated[float | None, refused(_BEAM, 1.0)] = None
    cache_salt: Annotated[
        str | None,
        refused("the prefix cache is shared by all requests: per-request salts are not supported"),
    ] = None
    kv_transfer_params: Annotated[dict[str, Any] | None, empty_only(_KV_TRANSFER)] = None
    vllm_xargs: Annotated[
        dict[str, Any] | None, empty_only("this server takes no custom sampling extensions")
    ] = None
    logits_processors: Annotated[
        list[Any] | None, empty_only("custom logits processors are not supported by this server")
    ] = None
    return_token_ids: Annotated[
        bool | None, refused("token ids in responses are not supported; see logprobs", False)
    ] = None
    guided_decoding_backend: Annotated[
        str | None, refused("the backend is the server's --guided-decoding-backend")
    ] = None
    guided_whitespace_pattern: Annotated[
        str | None, refused("a whitespace pattern is not supported; see structured_outputs")
    ] = None
    prompt_embeds: Annotated[
        Any, refused("prompt embeddings are not supported: send text or token ids")
    ] = None
    mm_processor_kwargs: Annotated[dict[str, Any] | None, empty_only(_MULTIMODAL)] = None


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


class FunctionCallIn(StrictModel):
    name: str
    arguments: str | dict[str, Any] = ""  # a JSON object in text (some clients send the object)


class ToolCallIn(StrictModel):
    """A call an assistant message made (as OpenAI returned it, sent back in the history)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn
    index: int | None = None  # present when a client rebuilt the call from stream deltas


class ChatMessage(StrictModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call answered
    reasoning_content: str | None = None  # assistant messages: their reasoning...
    reasoning: str | None = None  # ...under vLLM's newer name
    # What OpenAI's own answers carry, sent back with the history: fine when empty.
    refusal: Annotated[
        str | None, refused("refusal: send the refusal as the message's content instead", "")
    ] = None
    annotations: Annotated[list[Any] | None, empty_only("annotations are not supported")] = None
    audio: Annotated[Any, refused("audio messages are not supported by this server")] = None
    function_call: Annotated[
        Any, refused("function_call is deprecated: send the call in tool_calls")
    ] = None


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: UInt32 | None = None
    max_completion_tokens: UInt32 | None = None
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    include_reasoning: bool = True
    modalities: Annotated[
        list[str] | None, refused("this server answers in text only", ["text"])
    ] = None
    prediction: Annotated[Any, refused("predicted outputs are not supported by this server")] = None
    web_search_options: Annotated[Any, refused("web search is not supported by this server")] = None
    verbosity: Annotated[
        str | None, refused("verbosity is not supported: bound the answer with max_tokens")
    ] = None
    functions: Annotated[
        list[Any] | None, empty_only("functions is deprecated: send tools instead")
    ] = None
    prompt_cache_key: ShortStr | None = None  # a routing hint; the prefix cache needs none
    echo: Annotated[bool | None, refused("echo is not supported for chat", False)] = None
    thinking_token_budget: Annotated[
        int | None, refused("a thinking token budget is not supported; see max_tokens")
    ] = None
    media_io_kwargs: Annotated[dict[str, Any] | None, empty_only(_MULTIMODAL)] = None
    # vLLM's chat extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # for templates that take them (RAG)


class TokenizeCompletion(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(StrictModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = None
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


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[UInt32]
