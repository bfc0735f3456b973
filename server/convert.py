"""Conversion between the v1 protos and the engine's types: the only module importing both.

Requests become ``(prompt_token_ids, SamplingParams)``; engine outputs and model facts become
responses; engine errors become ``ServiceError``s whose field paths are the request's own
(``sampling.temperature``, ``stopping.max_tokens``, ``text``...).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

from llmrpc.engine.client.async_engine import EngineDeadError, EngineStateError
from llmrpc.engine.core_types import EngineStats, ModelInfo
from llmrpc.engine.lora.types import (
    LoRAAdapterExistsError,
    LoRAAdapterNotFoundError,
    check_adapter_name,
)
from llmrpc.engine.request import FinishReason, InvalidRequestError, RequestOutput, SamplingParams
from llmrpc.server.chat_render import render_chat
from llmrpc.server.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from llmrpc.server.prompt_bounds import check_can_fit
from llmrpc.server.structured_output import engine_spec
from llmrpc.v1 import admin_pb2, common_pb2, generation_pb2, tokenization_pb2

# An unset stopping.max_tokens: vLLM's SamplingParams default, cut to the room the context leaves.
DEFAULT_MAX_TOKENS = 16

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
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "logit_bias": "sampling.logit_bias",
    "allowed_token_ids": "sampling.allowed_token_ids",
    "bad_words": "sampling.bad_words",
    "n": "sampling.n",
    "logprobs": "output.logprobs",
    "prompt_logprobs": "output.prompt_logprobs",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
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
    name, bracket, index = engine_field.partition("[")  # "stop[2]": the third stop string
    return _FIELD_PATHS.get(name, name) + bracket + index


@contextlib.contextmanager
def engine_errors(request) -> Iterator[None]:
    """Turn the engine's errors for ``request`` into ``ServiceError``s."""
    try:
        yield
    except InvalidRequestError as error:
        raise InvalidArgument(field_path(error.field, request), error.message) from None
    except EngineDeadError as error:
        raise Unavailable(f"the engine has stopped and serves no requests: {error}") from None
    except EngineStateError as error:  # asleep, busy, or sleep mode off (or LoRA)
        raise FailedPrecondition("engine", str(error)) from None
    except LoRAAdapterNotFoundError as error:  # GenerateRequest.lora or an admin call's
        field = "lora" if "lora" in request.DESCRIPTOR.fields_by_name else "lora_name"
        raise NotFound("LoRA adapter", getattr(request, field), field, str(error)) from None
    except LoRAAdapterExistsError as error:
        raise AlreadyExists(f"lora_name: {error}") from None
    except DeadlineDropped:
        raise DeadlineExceeded(
            "the request could not start before the call's deadline at the server's current "
            "load; it was dropped from the queue without being computed"
        ) from None


# --- prompts -------------------------------------------------------------------------------


def prompt_token_ids(
    request, tokenizer, model_info: ModelInfo, max_tokens: int | None = None
) -> list[int]:
    """Token ids of a GenerateRequest's or TokenizeRequest's ``input`` oneof; a text that could
    not have ``max_tokens`` tokens or fewer is refused before it is tokenized."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("input", "set exactly one of text, token_ids or chat")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if tokenizer is None:
        raise InvalidArgument(kind, _NO_TOKENIZER)
    add_special = kind == "text"  # a chat template already writes the special tokens
    if request.HasField("add_special_tokens"):
        add_special = request.add_special_tokens
    if kind == "text":
        text = request.text
    else:
        text = render_chat(request.chat, tokenizer, model_info.has_chat_template)
    check_can_fit(kind, text, tokenizer, max_tokens)
    return tokenizer.encode(text, add_special_tokens=add_special)


# --- sampling parameters -------------------------------------------------------------------


def _optional(message, name: str, default):
    return getattr(message, name) if message.HasField(name) else default


def _max_tokens(stopping, num_prompt_tokens: int, model_info: ModelInfo) -> int:
    if stopping.HasField("max_tokens"):
        return stopping.max_tokens  # the engine checks it against the context window
    default = model_info.sampling_defaults.get("max_tokens", DEFAULT_MAX_TOKENS)
    return max(1, min(default, model_info.max_model_len - num_prompt_tokens))


def _time_limit_s(stopping: common_pb2.StoppingCriteria) -> float | None:
    return stopping.time_limit_ms / 1000 if stopping.HasField("time_limit_ms") else None


def server_defaults(model_info: ModelInfo) -> SamplingParams:
    """What unset fields mean: vLLM's defaults, then the model's generation config."""
    defaults = dict(model_info.sampling_defaults)
    defaults.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    return SamplingParams(**defaults)


def sampling_params(
    request: generation_pb2.GenerateRequest,
    num_prompt_tokens: int,
    model_info: ModelInfo,
    deadline: float | None = None,
) -> SamplingParams:
    """The engine's parameters for a GenerateRequest; unset fields take the server defaults."""
    sampling, stopping, output = request.sampling, request.stopping, request.output
    defaults = server_defaults(model_info)
    params = SamplingParams(
        **{
            name: _optional(sampling, name, getattr(defaults, name))
            for name in _OPTIONAL_SAMPLING_FIELDS
        },
        seed=_optional(sampling, "seed", None),
        logit_bias=dict(sampling.logit_bias),
        allowed_token_ids=list(sampling.allowed_token_ids) or None,
        bad_words=list(sampling.bad_words),
        max_tokens=_max_tokens(stopping, num_prompt_tokens, model_info),
        min_tokens=_optional(stopping, "min_tokens", defaults.min_tokens),
        stop=list(stopping.stop),
        stop_token_ids=list(stopping.stop_token_ids),
        ignore_eos=_optional(stopping, "ignore_eos", defaults.ignore_eos),
        include_stop_str_in_output=_optional(
            stopping, "include_stop_str_in_output", defaults.include_stop_str_in_output
        ),
        skip_special_tokens=_optional(output, "skip_special_tokens", defaults.skip_special_tokens),
        spaces_between_special_tokens=_optional(
            output, "spaces_between_special_tokens", defaults.spaces_between_special_tokens
        ),
        logprobs=_optional(output, "logprobs", None),
        prompt_logprobs=_optional(output, "prompt_logprobs", None),
        time_limit_s=_time_limit_s(stopping),
        truncate_prompt_tokens=_optional(request, "truncate_prompt_tokens", None),
        priority=_optional(request, "priority", 0),
        deadline=deadline,
        lora_name=request.lora or None,
    )
    # Here as well as in the engine: a bad request is refused before it takes a place in the
    # queue or reaches the engine's thread (sizes first, so a huge list is refused in O(1)).
    with engine_errors(request):
        params.validate()
        if request.lora:
            check_adapter_name(request.lora, "lora")
        if request.HasField("structured_output"):
            config = model_info.structured_output
            params.structured_output = engine_spec(request.structured_output, config)
    return params


# SamplingParams fields that are plain optional scalars of the proto's SamplingParams
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "n",
)


def to_engine_request(
    request: generation_pb2.GenerateRequest,
    tokenizer,
    model_info: ModelInfo,
    deadline: float | None = None,
) -> tuple[list[int], SamplingParams]:
    """``(prompt_token_ids, params)`` for ``AsyncEngine.generate``.

    ``deadline`` (``time.monotonic()``) is when the caller stops waiting: a queued request
    that cannot start in time is dropped early.
    """
    truncated = request.HasField("truncate_prompt_tokens")  # cut after tokenizing, as vLLM
    max_tokens = None if truncated else model_info.max_model_len
    prompt = prompt_token_ids(request, tokenizer, model_info, max_tokens)
    return prompt, sampling_params(request, len(prompt), model_info, deadline)


# --- outputs -------------------------------------------------------------------------------


class DeadlineDropped(Exception):
    """The engine dropped the queued request: its deadline could not be met."""


class OutputAccumulator:
    """Engine outputs of one request, merged per sample, made into GenerateResponses."""

    def __init__(self, request_id: str, params: SamplingParams, tokenizer) -> None:
        self.request_id = request_id
        self.num_samples = params.n
        self.tokenizer = tokenizer
        self.samples: dict[int, RequestOutput] = {}

    def add(self, output: RequestOutput) -> None:
        if output.finished and output.finish_reason is FinishReason.DEADLINE:
            raise DeadlineDropped
        earlier = self.samples.get(output.index)
        if earlier is None:
            # A copy: the delta itself may still be sent as a stream message.
            self.samples[output.index] = dataclasses.replace(
                output, token_ids=list(output.token_ids)
            )
        else:
            earlier.merge(output)

    @property
    def all_finished(self) -> bool:
        finished = sum(o.finished for o in self.samples.values())
        return finished == self.num_samples

    def stream_response(self, delta: RequestOutput) -> generation_pb2.GenerateResponse:
        """The stream message for one delta; the last one carries the usage of all samples."""
        response = self._sample_response(delta)
        if self.all_finished:
            self._set_usage(response)
        return response

    def unary_response(self) -> generation_pb2.GenerateResponse:
        response = self._sample_response(self.samples[0])
        if self.num_samples > 1:
            response.samples.extend(
                self._sample_response(self.samples[i]) for i in sorted(self.samples)
            )
        self._set_usage(response)
        return response

    def _sample_response(self, output: RequestOutput) -> generation_pb2.GenerateResponse:
        response = generation_pb2.GenerateResponse(
            request_id=self.request_id,
            text=output.text,
            token_ids=output.token_ids,
            index=output.index,
            logprobs=self._logprobs(output.logprobs or ()),
            prompt_logprobs=self._logprobs((output.prompt_logprobs or [None])[1:]),
        )
        if output.finished:
            response.finish_reason = _FINISH_REASONS[output.finish_reason]
            _set_matched_stop(response, output)
        return response

    def _set_usage(self, response: generation_pb2.GenerateResponse) -> None:
        first = self.samples[0]
        response.usage.prompt_tokens = first.num_prompt_tokens
        response.usage.cached_tokens = first.num_cached_tokens
        response.usage.completion_tokens = sum(o.num_output_tokens for o in self.samples.values())

    def _logprobs(self, entries) -> list[generation_pb2.TokenLogprob]:
        return [
            generation_pb2.TokenLogprob(
                token_id=entry.token_id,
                token=self._text(entry.token_id),
                logprob=entry.logprob,
                rank=entry.rank,
                top_logprobs=[
                    generation_pb2.TopLogprob(
                        token_id=token_id, token=self._text(token_id), logprob=logprob
                    )
                    for token_id, logprob in entry.top
                ],
            )
            for entry in entries
        ]

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""


def _set_matched_stop(response: generation_pb2.GenerateResponse, output: RequestOutput) -> None:
    # stop_reason is the matched stop string, or the stop/EOS token id.
    if isinstance(output.stop_reason, str):
        response.stop_string = output.stop_reason
    elif isinstance(output.stop_reason, int):
        response.stop_token_id = output.stop_reason


def engine_failure(output: RequestOutput) -> str | None:
    """The engine's message if the request ended with FINISH_REASON_ERROR, else None; raises
    ``InvalidArgument`` when the engine found the fault in the request's own input (a
    structured output it cannot build)."""
    if output.finished and output.finish_reason is FinishReason.ERROR:
        if output.error_field is not None:
            raise InvalidArgument(output.error_field, output.error or "cannot be served")
        return output.error or "the engine failed while serving the request"
    return None


# --- tokenization --------------------------------------------------------------------------


_NO_TOKENIZER = (
    "this server runs with --skip-tokenizer-init and has no tokenizer: send the prompt as token ids"
)


def _require_tokenizer(tokenizer) -> None:
    if tokenizer is None:
        raise FailedPrecondition(
            "tokenizer", "this server runs with --skip-tokenizer-init and has no tokenizer"
        )


def tokenize(
    request: tokenization_pb2.TokenizeRequest, tokenizer, model_info: ModelInfo
) -> tokenization_pb2.TokenizeResponse:
    _require_tokenizer(tokenizer)
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
    _require_tokenizer(tokenizer)
    token_ids = list(request.token_ids)
    vocab_size = model_info.vocab_size
    if any(t >= vocab_size for t in token_ids):
        message = f"token ids must be below the vocabulary size {vocab_size}"
        raise InvalidArgument("token_ids", message)
    skip = _optional(request, "skip_special_tokens", SamplingParams().skip_special_tokens)
    text = tokenizer.decode(token_ids, skip_special_tokens=skip)
    return tokenization_pb2.DetokenizeResponse(text=text)


# --- model facts ---------------------------------------------------------------------------


def _published_defaults(info: ModelInfo):
    """GetModelInfo's default_sampling, default_stopping and default_output."""
    defaults = server_defaults(info)
    sampling = common_pb2.SamplingParams(
        **{name: getattr(defaults, name) for name in _OPTIONAL_SAMPLING_FIELDS}
    )
    stopping = common_pb2.StoppingCriteria(
        max_tokens=defaults.max_tokens,
        min_tokens=defaults.min_tokens,
        ignore_eos=defaults.ignore_eos,
        include_stop_str_in_output=defaults.include_stop_str_in_output,
    )
    output = common_pb2.OutputOptions(skip_special_tokens=defaults.skip_special_tokens)
    return sampling, stopping, output


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
    )
    sampling, stopping, output = _published_defaults(info)
    response.default_sampling.CopyFrom(sampling)
    response.default_stopping.CopyFrom(stopping)
    response.default_output.CopyFrom(output)
    if info.bos_token_id is not None:
        response.bos_token_id = info.bos_token_id
    return response


def list_models_response(
    info: ModelInfo, adapters: list[dict] = (), hide_paths: bool = False
) -> admin_pb2.ListModelsResponse:
    """``hide_paths`` (--hide-model-path): each model's root is its name, not its folder."""
    models = [
        admin_pb2.Model(
            id=name,
            max_model_len=info.max_model_len,
            owned_by="llmrpc",
            root=name if hide_paths else info.model_dir,
        )
        for name in info.served_model_names
    ]
    models += [  # LoRA adapters after the base models, as vLLM lists them
        admin_pb2.Model(
            id=entry["name"],
            max_model_len=info.max_model_len,
            owned_by="llmrpc",
            root=entry["name"] if hide_paths else entry["path"],
            parent=entry["base_model_name"],
        )
        for entry in adapters
    ]
    return admin_pb2.ListModelsResponse(models=models)


# --- load figures --------------------------------------------------------------------------


def load_response(
    stats: EngineStats, per_engine: Sequence[EngineStats] = ()
) -> admin_pb2.GetLoadResponse:
    """``stats``; ``per_engine``: each data-parallel engine's own."""
    engines = [
        admin_pb2.EngineLoad(
            num_running_requests=each.num_running,
            num_waiting_requests=each.num_waiting,
            kv_cache_usage=each.kv_cache_usage,
            num_kv_blocks=each.num_total_blocks,
        )
        for each in per_engine
    ]
    return admin_pb2.GetLoadResponse(
        engines=engines,
        num_running_requests=stats.num_running,
        num_waiting_requests=stats.num_waiting,
        kv_cache_usage=stats.kv_cache_usage,
        num_kv_blocks=stats.num_total_blocks,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        prompt_throughput=stats.prompt_throughput,
        generation_throughput=stats.generation_throughput,
        is_sleeping=stats.is_sleeping,
        kv_cache_bytes=stats.kv_cache_bytes,
        device_memory_used_bytes=stats.device_memory_used_bytes,
        device_memory_total_bytes=stats.device_memory_total_bytes,
        device_utilization=stats.device_utilization,
        spec_decode=_spec_decode_counts(stats.spec_decode),
    )


def _spec_decode_counts(counts) -> admin_pb2.SpecDecodeCounts | None:
    if counts is None:
        return None
    return admin_pb2.SpecDecodeCounts(
        num_drafts=counts.num_drafts,
        num_draft_tokens=counts.num_draft_tokens,
        num_accepted_tokens=counts.num_accepted_tokens,
        num_accepted_tokens_per_pos=counts.accepted_per_pos,
    )
