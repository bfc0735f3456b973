"""Typed results of the client calls, and their conversion from the v1 protos.

Every result is a frozen dataclass with plain Python values (no proto objects leak out), so
callers can compare, print and serialize them (``dataclasses.asdict``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from google.protobuf import json_format

from llmrpc.common.spec_decode import SpecDecodeCounts
from llmrpc.v1 import admin_pb2, generation_pb2, tokenization_pb2


class FinishReason(str, enum.Enum):
    """Why a request ended (the proto's ``FinishReason`` without its prefix)."""

    LENGTH = "length"
    STOP_STRING = "stop_string"
    STOP_TOKEN = "stop_token"
    EOS = "eos"
    ABORT = "abort"
    TIME_LIMIT = "time_limit"
    ERROR = "error"


_FINISH_REASONS = {
    generation_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    generation_pb2.FINISH_REASON_STOP_STRING: FinishReason.STOP_STRING,
    generation_pb2.FINISH_REASON_STOP_TOKEN: FinishReason.STOP_TOKEN,
    generation_pb2.FINISH_REASON_EOS: FinishReason.EOS,
    generation_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    generation_pb2.FINISH_REASON_TIME_LIMIT: FinishReason.TIME_LIMIT,
    generation_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob, its rank (1: the most likely), and the top alternatives there."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top_logprobs: list[TopLogprob]


@dataclass(frozen=True)
class ToolCall:
    """A function call parsed from the output: its id, the function's name, and the arguments
    as a JSON object in text; ``index`` is its place among the output's calls."""

    id: str
    name: str
    arguments: str
    index: int = 0
    type: str = "function"


@dataclass(frozen=True)
class Sample:
    """One of a request's ``n`` samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    matched_stop: str | int | None  # the stop string or the stop/EOS token that ended it
    logprobs: list[TokenLogprob]  # one per token when ``logprobs`` was asked for, else empty
    reasoning_text: str = ""  # under the server's --reasoning-parser (chat)
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat with tools


@dataclass(frozen=True)
class Completion:
    """The whole output of a finished request (``generate``, ``chat``).

    The top-level fields are sample 0's; ``samples`` holds every sample in index order (one
    unless ``n`` > 1), and ``usage`` counts the tokens of all of them.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    matched_stop: str | int | None
    usage: Usage
    samples: list[Sample]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # from the 2nd token
    reasoning_text: str = ""  # sample 0's, under the server's --reasoning-parser (chat)
    tool_calls: list[ToolCall] = field(default_factory=list)  # sample 0's (chat with tools)


@dataclass(frozen=True)
class Delta:
    """One streamed increment of sample ``index``; each sample's last has ``finish_reason``,
    and the stream's last message has ``usage`` (all samples)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    usage: Usage | None = None
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # first message only
    reasoning_text: str = ""  # new reasoning (server's --reasoning-parser, chat)
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed in this delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Tokens:
    """``tokenize``'s result."""

    token_ids: list[int]
    token_strings: list[str]
    count: int
    max_model_len: int


@dataclass(frozen=True)
class ModelCard:
    """One served model, as in OpenAI's model list."""

    id: str
    max_model_len: int
    owned_by: str
    root: str = ""  # the folder the server loaded the model from (a LoRA adapter's folder)
    parent: str = ""  # a LoRA adapter's base model; "" for a base model


@dataclass(frozen=True)
class ServerInfo:
    version: str
    api_version: str
    tls: bool
    auth_required: bool
    prefix_caching: bool
    device: str
    services: list[str]
    config: dict[str, str]  # effective serve options, by option name
    admin_auth_required: bool = False  # ResetPrefixCache, Sleep, WakeUp need the admin key


@dataclass(frozen=True)
class ModelInfo:
    """A model's limits and the defaults that unset request fields take."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    has_chat_template: bool
    dtype: str
    block_size: int
    num_kv_blocks: int
    # Proto field name -> value, for the fields the server sets (e.g. {"temperature": 1.0}).
    default_sampling: dict = field(default_factory=dict)
    default_stopping: dict = field(default_factory=dict)
    default_output: dict = field(default_factory=dict)
    # "generate" or "pooling" (embeddings only); None from a server that does not say.
    runner: str | None = None
    # An embedding's length; None unless the runner is "pooling".
    embedding_size: int | None = None


# Speculative decoding's counters since start (``GetLoadResponse.spec_decode``); subtract two
# readings for a run's share
SpecDecode = SpecDecodeCounts


@dataclass(frozen=True)
class Load:
    """What the engine is doing now (``AdminService.GetLoad``)."""

    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float  # fraction of KV cache blocks in use
    num_kv_blocks: int
    prefix_cache_hit_rate: float  # since start
    prompt_throughput: float  # tokens per second, recent window
    generation_throughput: float  # tokens per second, recent window
    is_sleeping: bool
    kv_cache_bytes: int = 0
    device_memory_used_bytes: int = 0  # on CUDA; 0 on the CPU
    device_memory_total_bytes: int = 0
    device_utilization: float | None = None  # on CUDA where NVML reads it
    # Seconds since the engine last reported, and whether it has stalled (health NOT_SERVING
    # meanwhile); None from a server that does not say.
    figures_age_s: float | None = None
    engine_stalled: bool | None = None
    spec_decode: SpecDecode | None = None  # a server with --speculative-config


def _matched_stop(response: generation_pb2.GenerateResponse) -> str | int | None:
    which = response.WhichOneof("matched_stop")
    return getattr(response, which) if which else None


def _usage(response: generation_pb2.GenerateResponse) -> Usage | None:
    if not response.HasField("usage"):
        return None
    u = response.usage
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def _logprobs(entries) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token_id=e.token_id,
            token=e.token,
            logprob=e.logprob,
            rank=e.rank,
            top_logprobs=[TopLogprob(t.token_id, t.token, t.logprob) for t in e.top_logprobs],
        )
        for e in entries
    ]


def _tool_calls(calls) -> list[ToolCall]:
    return [
        ToolCall(c.id, c.function.name, c.function.arguments, c.index, c.type or "function")
        for c in calls
    ]


def _sample(response: generation_pb2.GenerateResponse) -> Sample:
    return Sample(
        index=response.index,
        text=response.text,
        token_ids=list(response.token_ids),
        finish_reason=_FINISH_REASONS[response.finish_reason],
        matched_stop=_matched_stop(response),
        logprobs=_logprobs(response.logprobs),
        reasoning_text=response.reasoning_text,
        tool_calls=_tool_calls(response.tool_calls),
    )


def completion_from_proto(response: generation_pb2.GenerateResponse) -> Completion:
    first = _sample(response)
    return Completion(
        request_id=response.request_id,
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=first.finish_reason,
        matched_stop=first.matched_stop,
        usage=_usage(response) or Usage(0, len(first.token_ids), 0),
        samples=[_sample(s) for s in response.samples] or [first],
        logprobs=first.logprobs,
        prompt_logprobs=_logprobs(response.prompt_logprobs),
        reasoning_text=first.reasoning_text,
        tool_calls=first.tool_calls,
    )


def delta_from_proto(response: generation_pb2.GenerateResponse) -> Delta:
    return Delta(
        request_id=response.request_id,
        text=response.text,
        token_ids=list(response.token_ids),
        finish_reason=_FINISH_REASONS.get(response.finish_reason),
        matched_stop=_matched_stop(response),
        usage=_usage(response),
        index=response.index,
        logprobs=_logprobs(response.logprobs),
        prompt_logprobs=_logprobs(response.prompt_logprobs),
        reasoning_text=response.reasoning_text,
        tool_calls=_tool_calls(response.tool_calls),
    )


def tokens_from_proto(response: tokenization_pb2.TokenizeResponse) -> Tokens:
    return Tokens(
        token_ids=list(response.token_ids),
        token_strings=list(response.token_strings),
        count=response.count,
        max_model_len=response.max_model_len,
    )


def models_from_proto(response: admin_pb2.ListModelsResponse) -> list[ModelCard]:
    return [ModelCard(m.id, m.max_model_len, m.owned_by, m.root, m.parent) for m in response.models]


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded LoRA adapter: the name requests use, its folder on the server, its base model."""

    name: str
    path: str
    base_model_name: str


def lora_adapter_from_proto(adapter: admin_pb2.LoraAdapter) -> LoraAdapter:
    return LoraAdapter(adapter.name, adapter.path, adapter.base_model_name)


def server_info_from_proto(response: admin_pb2.GetServerInfoResponse) -> ServerInfo:
    capabilities = response.capabilities
    return ServerInfo(
        version=response.version,
        api_version=response.api_version,
        tls=capabilities.tls,
        auth_required=capabilities.auth_required,
        prefix_caching=capabilities.prefix_caching,
        device=capabilities.device,
        services=list(capabilities.services),
        config=dict(response.config),
        admin_auth_required=capabilities.admin_auth_required,
    )


def _set_fields(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def model_info_from_proto(response: admin_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model=response.model,
        max_model_len=response.max_model_len,
        vocab_size=response.vocab_size,
        eos_token_ids=list(response.eos_token_ids),
        bos_token_id=response.bos_token_id if response.HasField("bos_token_id") else None,
        has_chat_template=response.has_chat_template,
        dtype=response.dtype,
        block_size=response.block_size,
        num_kv_blocks=response.num_kv_blocks,
        default_sampling=_set_fields(response.default_sampling),
        default_stopping=_set_fields(response.default_stopping),
        default_output=_set_fields(response.default_output),
        runner=_RUNNER_NAMES.get(response.runner) if response.HasField("runner") else None,
        embedding_size=(response.embedding_size if response.HasField("embedding_size") else None),
    )


_RUNNER_NAMES = {
    admin_pb2.GetModelInfoResponse.RUNNER_GENERATE: "generate",
    admin_pb2.GetModelInfoResponse.RUNNER_POOLING: "pooling",
}


def load_from_proto(response: admin_pb2.GetLoadResponse) -> Load:
    return Load(
        num_running_requests=response.num_running_requests,
        num_waiting_requests=response.num_waiting_requests,
        kv_cache_usage=response.kv_cache_usage,
        num_kv_blocks=response.num_kv_blocks,
        prefix_cache_hit_rate=response.prefix_cache_hit_rate,
        prompt_throughput=response.prompt_throughput,
        generation_throughput=response.generation_throughput,
        is_sleeping=response.is_sleeping,
        kv_cache_bytes=int(response.kv_cache_bytes),
        device_memory_used_bytes=int(response.device_memory_used_bytes),
        device_memory_total_bytes=int(response.device_memory_total_bytes),
        device_utilization=response.device_utilization
        if response.HasField("device_utilization")
        else None,
        figures_age_s=response.figures_age_seconds
        if response.HasField("figures_age_seconds")
        else None,
        engine_stalled=response.engine_stalled if response.HasField("engine_stalled") else None,
        spec_decode=_spec_decode(response.spec_decode)
        if response.HasField("spec_decode")
        else None,
    )


def _spec_decode(counts: admin_pb2.SpecDecodeCounts) -> SpecDecode:
    return SpecDecode(
        int(counts.num_drafts),
        int(counts.num_draft_tokens),
        int(counts.num_accepted_tokens),
        tuple(int(n) for n in counts.num_accepted_tokens_per_pos),
    )
