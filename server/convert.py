"""Conversion between the v1 protos and the engine's types: the only module importing both.

Requests become ``(prompt_token_ids, SamplingParams)``; engine outputs and model facts become
responses; engine errors become ``ServiceError``s whose field paths are the request's own
(``sampling.temperature``, ``stopping.max_tokens``, ``text``...).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jinja2 import TemplateError

from llmrpc.engine.async_engine import EngineDeadError
from llmrpc.engine.core import ModelInfo
from llmrpc.engine.request import FinishReason, InvalidRequestError, RequestOutput, SamplingParams
from llmrpc.server.errors import InvalidArgument, Unavailable
from llmrpc.v1 import admin_pb2, common_pb2, generation_pb2, tokenization_pb2

# An unset stopping.max_tokens: vLLM's SamplingParams default, cut to the room the context leaves.
DEFAULT_MAX_TOKENS = 16
_DEFAULTS = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)

# Engine parameter name -> field path in GenerateRequest ("input" is the oneof's set field).
_FIELD_PATHS = {
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "max_tokens": "stopping.max_tokens",
    "min_tokens": "stopping.min_tokens",
    "stop": "stopping.stop",
    "stop_token_ids": "stopping.stop_token_ids",
    "ignore_eos": "stopping.ignore_eos",
    "include_stop_str_in_output": "stopping.include_stop_str_in_output",
    "time_limit_s": "stopping.time_limit_ms",
    "skip_special_tokens": "output.skip_special_tokens",
}

_FINISH_REASONS = {
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP_STRING: generation_pb2.FINISH_REASON_STOP_STRING,
    FinishReason.STOP_TOKEN: generation_pb2.FINISH_REASON_STOP_TOKEN,
    FinishReason.EOS: generation_pb2.FINISH_REASON_EOS,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
    FinishReason.TIME_LIMIT: generation_pb2.FINISH_REASON_TIME_LIMIT,
    FinishReason.ERROR: generation_pb2.FINISH_REASON_ERROR,
}


# --- errors --------------------------------------------------------------------------------


def field_path(engine_field: str, request) -> str:
    """The request field an engine error names: ``"input"`` becomes the set oneof field."""
    if engine_field == "input":
        return request.WhichOneof("input") or "input"
    return _FIELD_PATHS.get(engine_field, engine_field)


@contextlib.contextmanager
def engine_errors(request) -> Iterator[None]:
    """Turn the engine's errors for ``request`` into ``ServiceError``s."""
    try:
        yield
    except InvalidRequestError as error:
        raise InvalidArgument(field_path(error.field, request), error.message) from None
    except EngineDeadError as error:
        raise Unavailable(f"the engine has stopped and serves no requests: {error}") from None


# --- prompts -------------------------------------------------------------------------------


def _render_chat(chat: common_pb2.Chat, tokenizer, has_chat_template: bool) -> str:
    if not has_chat_template:
        raise InvalidArgument(
            "chat", "the model's tokenizer has no chat template; send text or token_ids instead"
        )
    if not chat.messages:
        raise InvalidArgument("chat.messages", "must hold at least one message")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add_generation_prompt = (
        chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    )
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except TemplateError as error:  # e.g. "roles must alternate user/assistant"
        raise InvalidArgument("chat", f"the chat template rejected the messages: {error}") from None


def prompt_token_ids(request, tokenizer, model_info: ModelInfo) -> list[int]:
    """Token ids of a GenerateRequest's or TokenizeRequest's ``input`` oneof."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("input", "set exactly one of text, token_ids or chat")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    add_special = kind == "text"  # a chat template already writes the special tokens
    if request.HasField("add_special_tokens"):
        add_special = request.add_special_tokens
    if kind == "text":
        text = request.text
    else:
        text = _render_chat(request.chat, tokenizer, model_info.has_chat_template)
    return tokenizer.encode(text, add_special_tokens=add_special)


# --- sampling parameters -------------------------------------------------------------------


def _optional(message, name: str, default):
    return getattr(message, name) if message.HasField(name) else default


def _max_tokens(stopping: common_pb2.StoppingCriteria, num_prompt_tokens: int, max_model_len: int):
    if stopping.HasField("max_tokens"):
        return stopping.max_tokens  # the engine checks it against the context window
    return max(1, min(DEFAULT_MAX_TOKENS, max_model_len - num_prompt_tokens))


def _time_limit_s(stopping: common_pb2.StoppingCriteria) -> float | None:
    return stopping.time_limit_ms / 1000 if stopping.HasField("time_limit_ms") else None


def sampling_params(
    request: generation_pb2.GenerateRequest, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """The engine's parameters for a GenerateRequest; unset fields take the server defaults."""
    sampling, stopping, output = request.sampling, request.stopping, request.output
    return SamplingParams(
        temperature=_optional(sampling, "temperature", _DEFAULTS.temperature),
        top_p=_optional(sampling, "top_p", _DEFAULTS.top_p),
        top_k=_optional(sampling, "top_k", _DEFAULTS.top_k),
        min_p=_optional(sampling, "min_p", _DEFAULTS.min_p),
        seed=_optional(sampling, "seed", None),
        max_tokens=_max_tokens(stopping, num_prompt_tokens, max_model_len),
        min_tokens=_optional(stopping, "min_tokens", _DEFAULTS.min_tokens),
        stop=list(stopping.stop),
        stop_token_ids=list(stopping.stop_token_ids),
        ignore_eos=_optional(stopping, "ignore_eos", _DEFAULTS.ignore_eos),
        include_stop_str_in_output=_optional(
            stopping, "include_stop_str_in_output", _DEFAULTS.include_stop_str_in_output
        ),
        skip_special_tokens=_optional(output, "skip_special_tokens", _DEFAULTS.skip_special_tokens),
        time_limit_s=_time_limit_s(stopping),
    )


def to_engine_request(
    request: generation_pb2.GenerateRequest, tokenizer, model_info: ModelInfo
) -> tuple[list[int], SamplingParams]:
    """``(prompt_token_ids, params)`` for ``AsyncEngine.generate``."""
    prompt = prompt_token_ids(request, tokenizer, model_info)
    return prompt, sampling_params(request, len(prompt), model_info.max_model_len)


# --- outputs -------------------------------------------------------------------------------


def merge_outputs(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Accumulate engine deltas into the whole output so far (for the unary call)."""
    if total is None:
        return delta
    total.merge(delta)
    return total


def _set_matched_stop(response: generation_pb2.GenerateResponse, output: RequestOutput) -> None:
    # stop_reason is the matched stop string, or the stop/EOS token id.
    if isinstance(output.stop_reason, str):
        response.stop_string = output.stop_reason
    elif isinstance(output.stop_reason, int):
        response.stop_token_id = output.stop_reason


def to_generate_response(request_id: str, output: RequestOutput) -> generation_pb2.GenerateResponse:
    """A GenerateResponse for one engine output (a stream delta, or the merged whole)."""
    response = generation_pb2.GenerateResponse(
        request_id=request_id, text=output.text, token_ids=output.token_ids
    )
    if output.finished:
        response.finish_reason = _FINISH_REASONS[output.finish_reason]
        _set_matched_stop(response, output)
        response.usage.prompt_tokens = output.num_prompt_tokens
        response.usage.completion_tokens = output.num_output_tokens
        response.usage.cached_tokens = output.num_cached_tokens
    return response


def engine_failure(output: RequestOutput) -> str | None:
    """The engine's message if the request ended with FINISH_REASON_ERROR, else None."""
    if output.finished and output.finish_reason is FinishReason.ERROR:
        return output.error or "the engine failed while serving the request"
    return None


# --- tokenization --------------------------------------------------------------------------


def tokenize(
    request: tokenization_pb2.TokenizeRequest, tokenizer, model_info: ModelInfo
) -> tokenization_pb2.TokenizeResponse:
    token_ids = prompt_token_ids(request, tokenizer, model_info)
    return tokenization_pb2.TokenizeResponse(
        token_ids=token_ids,
        token_strings=tokenizer.convert_ids_to_tokens(token_ids),
        count=len(token_ids),
        max_model_len=model_info.max_model_len,
    )


def detokenize(
    request: tokenization_pb2.DetokenizeRequest, tokenizer, model_info: ModelInfo
) -> tokenization_pb2.DetokenizeResponse:
    token_ids = list(request.token_ids)
    vocab_size = model_info.vocab_size
    if any(t >= vocab_size for t in token_ids):
        message = f"token ids must be below the vocabulary size {vocab_size}"
        raise InvalidArgument("token_ids", message)
    skip = _optional(request, "skip_special_tokens", _DEFAULTS.skip_special_tokens)
    text = tokenizer.decode(token_ids, skip_special_tokens=skip)
    return tokenization_pb2.DetokenizeResponse(text=text)


# --- model facts ---------------------------------------------------------------------------


def _default_sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=_DEFAULTS.temperature,
        top_p=_DEFAULTS.top_p,
        top_k=_DEFAULTS.top_k,
        min_p=_DEFAULTS.min_p,
    )


def _default_stopping() -> common_pb2.StoppingCriteria:
    return common_pb2.StoppingCriteria(
        max_tokens=DEFAULT_MAX_TOKENS,
        min_tokens=_DEFAULTS.min_tokens,
        ignore_eos=_DEFAULTS.ignore_eos,
        include_stop_str_in_output=_DEFAULTS.include_stop_str_in_output,
    )


def model_info_response(name: str, info: ModelInfo) -> admin_pb2.GetModelInfoResponse:
    response = admin_pb2.GetModelInfoResponse(
        model=name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=sorted(info.eos_token_ids),
        has_chat_template=info.has_chat_template,
        dtype=info.dtype,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        default_sampling=_default_sampling(),
        default_stopping=_default_stopping(),
        default_output=common_pb2.OutputOptions(skip_special_tokens=_DEFAULTS.skip_special_tokens),
    )
    if info.bos_token_id is not None:
        response.bos_token_id = info.bos_token_id
    return response


def list_models_response(info: ModelInfo) -> admin_pb2.ListModelsResponse:
    models = [
        admin_pb2.Model(id=name, max_model_len=info.max_model_len, owned_by="llmrpc")
        for name in info.served_model_names
    ]
    return admin_pb2.ListModelsResponse(models=models)
