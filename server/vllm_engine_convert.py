"""Conversion for ``vllm.grpc.engine.VllmEngine`` (``server/vllm_engine.py``): its GenerateRequest
becomes a v1 GenerateRequest (token ids in, as the smg router sends them); the engine's outputs
become its chunks and Completes; the prefix cache's events become ``smg.grpc.common`` batches.

Its SamplingParams reads zero as "the default" where vLLM does (top_p, top_k, min_p, the
penalties, n); the optional fields are passed on when set. What llmrpc cannot serve is refused
by name (INVALID_ARGUMENT): media inputs, KV transfer (disaggregated prefill), all-vocabulary
logprobs (-1). Errors name the request's own fields (``sampling_params.temperature``,
``tokenized.input_ids``), not the v1 API's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from llmrpc.engine.client.kv_events import KVEventBatch
from llmrpc.engine.core_types import ModelInfo
from llmrpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from llmrpc.engine.request import FinishReason, RequestOutput, TokenLogprobs
from llmrpc.server.errors import InvalidArgument
from llmrpc.v1 import generation_pb2
from llmrpc.vllm_engine import common_pb2
from llmrpc.vllm_engine import vllm_engine_pb2 as pb

# Engine finish reasons -> the words vLLM's servicer answers (a sample that ends on an error
# never gets a Complete: the call ends with its status).
FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.STOP_STRING: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.EOS: "stop",
    FinishReason.ABORT: "abort",
}

# Request fields llmrpc cannot serve: text models only, no KV transfer between workers.
_REFUSED = {
    "mm_inputs": "media inputs are not served: llmrpc serves text models",
    "extra_mm_inputs": "media inputs are not served: llmrpc serves text models",
    "media_refs": "media inputs are not served: llmrpc serves text models",
    "kv_transfer_params": "KV transfer (disaggregated prefill and decode) is not served",
    "kv_transfer_params_json": "KV transfer (disaggregated prefill and decode) is not served",
}

# A v1 field path's first part -> this service's (errors name the caller's fields).
_PATH_PREFIXES = {
    "sampling": "sampling_params",
    "stopping": "sampling_params",
    "output": "sampling_params",
    "structured_output": "sampling_params",
    "token_ids": "tokenized.input_ids",
    "truncate_prompt_tokens": "sampling_params.truncate_prompt_tokens",
}
_SEED_RANGE = 2**32
_INT64_SIGN = 2**63
_UINT64 = 2**64


def check_refused(request: pb.GenerateRequest) -> None:
    for field, why in _REFUSED.items():
        descriptor = request.DESCRIPTOR.fields_by_name[field]
        present = (
            len(getattr(request, field)) > 0 if descriptor.is_repeated else request.HasField(field)
        )
        if present:
            raise InvalidArgument(field, why)


def v1_request(
    request: pb.GenerateRequest, model_info: ModelInfo
) -> generation_pb2.GenerateRequest:
    """The v1 GenerateRequest that serves ``request``."""
    check_refused(request)
    v1 = generation_pb2.GenerateRequest(request_id=request.request_id)
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        v1.token_ids.ids.extend(request.tokenized.input_ids)
    elif kind == "text":
        v1.text = request.text
    else:
        raise InvalidArgument("input", "set tokenized (token ids) or text")
    params = request.sampling_params
    _sampling(params, v1.sampling)
    _stopping(params, v1.stopping)
    _output(params, v1.output)
    _constraint(params, v1)
    if params.HasField("truncate_prompt_tokens"):
        truncate = params.truncate_prompt_tokens
        if truncate < -1:
            raise InvalidArgument(
                "sampling_params.truncate_prompt_tokens", "must be -1 (the context length) or >= 1"
            )
        v1.truncate_prompt_tokens = model_info.max_model_len if truncate == -1 else truncate
    if not params.HasField("max_tokens") and kind == "tokenized":
        # unset: up to the context window, as vLLM (a text prompt's length is not known here:
        # it takes the server's default, max_tokens of the model's generation config or 16)
        length = len(request.tokenized.input_ids)
        if v1.HasField("truncate_prompt_tokens"):
            length = min(length, v1.truncate_prompt_tokens)
        if length < model_info.max_model_len:
            v1.stopping.max_tokens = model_info.max_model_len - length
    return v1


def _sampling(params: pb.SamplingParams, sampling) -> None:
    if params.HasField("temperature"):
        sampling.temperature = params.temperature
    for name in ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if getattr(params, name):  # 0: the default
            setattr(sampling, name, getattr(params, name))
    if params.top_k:
        sampling.top_k = params.top_k
    if params.n:
        sampling.n = params.n
    if params.HasField("seed"):  # int32 here, uint32 in v1: a negative seed maps one to one
        sampling.seed = params.seed % _SEED_RANGE
    for token_id, bias in params.logit_bias.items():
        if token_id < 0:
            raise InvalidArgument("sampling_params.logit_bias", f"token id {token_id} is negative")
        sampling.logit_bias[token_id] = bias


def _stopping(params: pb.SamplingParams, stopping) -> None:
    if params.HasField("max_tokens"):
        stopping.max_tokens = params.max_tokens
    if params.min_tokens:
        stopping.min_tokens = params.min_tokens
    stopping.stop.extend(params.stop)
    stopping.stop_token_ids.extend(params.stop_token_ids)
    stopping.ignore_eos = params.ignore_eos
    stopping.include_stop_str_in_output = params.include_stop_str_in_output


def _output(params: pb.SamplingParams, output) -> None:
    output.skip_special_tokens = params.skip_special_tokens
    output.spaces_between_special_tokens = params.spaces_between_special_tokens
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name):
            value = getattr(params, name)
            if value < 0:
                raise InvalidArgument(
                    f"sampling_params.{name}",
                    f"{value}: the whole vocabulary's logprobs are not served; ask for N >= 0",
                )
            setattr(output, name, value)


def _constraint(params: pb.SamplingParams, v1: generation_pb2.GenerateRequest) -> None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return
    structured = v1.structured_output
    if kind == "choice":
        structured.choice.choices.extend(params.choice.choices)
    else:  # json_schema, regex, grammar, structural_tag, json_object: the same names in v1
        setattr(structured, kind, getattr(params, kind))


@contextlib.contextmanager
def in_request_terms() -> Iterator[None]:
    """INVALID_ARGUMENT from the v1 path's checks, naming this service's field."""
    try:
        yield
    except InvalidArgument as error:
        first, dot, rest = error.field.partition(".")
        prefix = _PATH_PREFIXES.get(first)
        if prefix is None:
            raise
        field = f"{prefix}.{rest}" if rest and prefix == "sampling_params" else prefix
        if first == "structured_output" and not rest:
            field = "sampling_params.constraint"
        raise InvalidArgument(field, error.message.removeprefix(f"{error.field}: ")) from None


# --- outputs -------------------------------------------------------------------------------


def output_logprobs(entries: list[TokenLogprobs] | None) -> pb.OutputLogProbs | None:
    if not entries:
        return None
    message = pb.OutputLogProbs()
    for entry in entries:
        message.token_ids.append(entry.token_id)
        message.token_logprobs.append(entry.logprob)
        message.top_logprobs.append(_top(entry.top))
    return message


def input_logprobs(
    entries: list[TokenLogprobs | None] | None, first_token: int | None
) -> pb.InputLogProbs | None:
    """The prompt's logprobs (its first token has none: unset value)."""
    if not entries:
        return None
    message = pb.InputLogProbs()
    for position, entry in enumerate(entries):
        if entry is None:
            message.token_logprobs.add()
            message.token_ids.append(first_token if position == 0 and first_token else 0)
            message.top_logprobs.add()
            continue
        message.token_logprobs.add(value=entry.logprob)
        message.token_ids.append(entry.token_id)
        message.top_logprobs.append(_top(entry.top))
    return message


def _top(top: list[tuple[int, float]]) -> pb.TopLogProbs:
    return pb.TopLogProbs(token_ids=[t for t, _ in top], values=[v for _, v in top])


def chunk(
    delta: RequestOutput, first_token: int | None, with_prompt_logprobs: bool
) -> pb.GenerateResponse:
    """One sample's tokens since its previous chunk."""
    message = pb.GenerateStreamChunk(
        token_ids=delta.token_ids,
        prompt_tokens=delta.num_prompt_tokens,
        completion_tokens=len(delta.token_ids),
        cached_tokens=delta.num_cached_tokens,
        output_logprobs=output_logprobs(delta.logprobs),
        input_logprobs=input_logprobs(delta.prompt_logprobs, first_token)
        if with_prompt_logprobs
        else None,
        index=delta.index,
    )
    return pb.GenerateResponse(chunk=message)


def complete(
    sample: RequestOutput, first_token: int | None, prompt_logprobs
) -> pb.GenerateResponse:
    """The end of a sample: ``sample`` holds its output ids (all of them, or in a stream the
    last chunk's, as vLLM's servicer sends them) and its logprobs; counts are the sample's."""
    message = pb.GenerateComplete(
        output_ids=sample.token_ids,
        finish_reason=FINISH_REASONS.get(sample.finish_reason, "stop"),
        prompt_tokens=sample.num_prompt_tokens,
        completion_tokens=sample.num_output_tokens,
        cached_tokens=sample.num_cached_tokens,
        output_logprobs=output_logprobs(sample.logprobs),
        input_logprobs=input_logprobs(prompt_logprobs, first_token),
        index=sample.index,
    )
    if isinstance(sample.stop_reason, str):
        message.matched_stop_str = sample.stop_reason
    elif isinstance(sample.stop_reason, int):
        message.matched_token_id = sample.stop_reason
    return pb.GenerateResponse(complete=message)


# --- KV-cache events -----------------------------------------------------------------------


def int64(block_hash: int | bytes) -> int:
    """A block hash as the signed 64-bit integer the protocol carries: an integer's low 64 bits
    (the built-in hash is one already), a digest's last 8 bytes."""
    value = int.from_bytes(block_hash[-8:], "big") if isinstance(block_hash, bytes) else block_hash
    value %= _UINT64
    return value - _UINT64 if value >= _INT64_SIGN else value


def event_batch(batch: KVEventBatch, first_event_id: int) -> common_pb2.KvEventBatch:
    """``batch`` as the protocol's, its events numbered from ``first_event_id``."""
    message = common_pb2.KvEventBatch(
        sequence_number=batch.sequence_number, timestamp=batch.timestamp
    )
    if batch.dp_rank is not None:
        message.dp_rank = batch.dp_rank
    for number, event in enumerate(batch.events, start=first_event_id):
        added = message.events.add(event_id=number)
        if isinstance(event, BlockStored):
            stored = added.stored
            size = event.block_size
            for index, block_hash in enumerate(event.block_hashes):
                block = stored.blocks.add(
                    block_hash=int64(block_hash),
                    token_ids=event.token_ids[index * size : (index + 1) * size],
                    block_size=size,
                )
                if event.lora_id is not None:
                    block.lora_id = event.lora_id
            if event.parent_block_hash is not None:
                stored.parent_block_hash = int64(event.parent_block_hash)
            if event.lora_name is not None:
                stored.lora_name = event.lora_name
        elif isinstance(event, BlockRemoved):
            added.removed.block_hashes.extend(int64(h) for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            added.cleared.SetInParent()
    return message
