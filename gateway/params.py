"""OpenAI request fields -> the gRPC client's generation parameters and chat rendering options.

What the gRPC API cannot do is refused with a 400 naming the parameter, never ignored.
"""

from __future__ import annotations

from llmrpc.clients import ChatOptions
from llmrpc.gateway.errors import invalid
from llmrpc.gateway.openai_models import (
    UINT32_MAX,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from llmrpc.gateway.settings import ApiSettings
from llmrpc.gateway.structured_output import structured_output

# Request fields passed to the gRPC API as they are (GenerateParams has the same names).
_DIRECT = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "add_special_tokens",
    "truncate_prompt_tokens",
    "priority",
    "allowed_token_ids",
    "bad_words",
)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    try:
        by_id = {int(token_id): value for token_id, value in bias.items()}
    except ValueError:
        raise invalid("logit_bias", "keys must be token ids (integers as strings)") from None
    if any(not 0 <= token_id <= UINT32_MAX for token_id in by_id):
        raise invalid("logit_bias", f"keys must be token ids, from 0 to {UINT32_MAX}")
    return by_id


def sampling_params(request: SamplingFields, max_tokens: int | None) -> dict:
    params = {name: getattr(request, name) for name in _DIRECT}
    params["max_tokens"] = max_tokens
    if request.logit_bias:
        params["logit_bias"] = _logit_bias(request.logit_bias)
    return {name: value for name, value in params.items() if value is not None}


def _structured(request: SamplingFields, params: dict) -> dict[str, str]:
    """Adds the request's structured output to ``params``; returns the names of its errors."""
    spec, names = structured_output(request)
    if spec is not None:
        params["structured_output"] = spec
    return names


def completion_params(request: CompletionRequest) -> tuple[dict, dict[str, str]]:
    """The client's generation parameters, and the gRPC field paths -> parameters they add."""
    if request.suffix is not None:
        raise invalid("suffix", "suffix (insertion) is not supported by this server's models")
    if request.best_of is not None and request.best_of != request.n:
        raise invalid("best_of", "best_of is not supported; use n")
    params = sampling_params(request, request.max_tokens)
    if request.logprobs is not None:
        params["logprobs"] = request.logprobs
        if request.echo:
            params["prompt_logprobs"] = request.logprobs
    if request.prompt_logprobs is not None:
        params["prompt_logprobs"] = request.prompt_logprobs
    return params, _structured(request, params)


def chat_params(request: ChatCompletionRequest) -> tuple[dict, dict[str, str]]:
    """The client's generation parameters, and the gRPC field paths -> parameters they add."""
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs set to true")
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    params = sampling_params(request, max_tokens)
    if request.logprobs:
        params["logprobs"] = request.top_logprobs or 0
    if request.prompt_logprobs is not None:
        params["prompt_logprobs"] = request.prompt_logprobs
    return params, _structured(request, params)


def _content(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for number, part in enumerate(message.content):
        param = f"messages[{index}].content[{number}]"
        if part.type != "text":
            raise invalid(
                f"{param}.type",
                f"{param}.type: content parts of type {part.type!r} are not supported: text only",
            )
        if part.text is None:
            raise invalid(f"{param}.text", f"{param}.text: a text part needs its text")
        texts.append(part.text)
    return "\n".join(texts)


def _message(message: ChatMessage, index: int) -> dict:
    """One message as the gRPC client takes it (OpenAI's shape)."""
    out: dict = {"role": message.role, "content": _content(message, index)}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude={"index"}) for call in message.tool_calls]
    for name in ("tool_call_id", "name"):
        if getattr(message, name) is not None:
            out[name] = getattr(message, name)
    reasoning = message.reasoning_content
    if reasoning is None:
        reasoning = message.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    return [_message(m, i) for i, m in enumerate(messages)]


def _template_kwargs(request) -> dict | None:
    kwargs = dict(request.chat_template_kwargs or {})
    effort = getattr(request, "reasoning_effort", None)
    if effort is not None:  # as vLLM: templates read it, and thinking follows it
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    if getattr(request, "documents", None):
        kwargs.setdefault("documents", request.documents)
    return kwargs or None


def _tool_choice(request) -> str | dict | None:
    choice = getattr(request, "tool_choice", None)
    return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


def chat_options(request, settings: ApiSettings) -> ChatOptions:
    """Rendering options of a chat completion or chat tokenization request."""
    if request.add_generation_prompt and request.continue_final_message:
        raise invalid(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        )
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
    content_format = settings.chat_template_content_format
    return ChatOptions(
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message or None,
        chat_template=request.chat_template or settings.chat_template,
        chat_template_kwargs=_template_kwargs(request),
        content_format=None if content_format == "auto" else content_format,
        tools=tools or None,
        tool_choice=_tool_choice(request),
        parallel_tool_calls=getattr(request, "parallel_tool_calls", None),
    )


def response_role(request: ChatCompletionRequest, settings: ApiSettings) -> str:
    if request.add_generation_prompt:
        return settings.response_role
    return request.messages[-1].role
