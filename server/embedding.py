"""EmbeddingService: a batch of inputs becomes one engine request each, run concurrently in the
engine's batch; each input's result is its vector or its own error, so one bad input never fails
the others. Errors of the whole call (model, dimensions, too many inputs, a stopped engine, an
input dropped from the queue because the call's deadline cannot be met) are the call's status.
"""

from __future__ import annotations

import logging
import time

from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from llmrpc.common.aio import gather_or_cancel
from llmrpc.common.fanout import DEFAULT_MAX_PROMPTS_PER_REQUEST
from llmrpc.engine.client.async_engine import EngineDeadError, EngineStateError
from llmrpc.engine.pooling.params import PoolingParams
from llmrpc.engine.request import FinishReason, InvalidRequestError, SamplingParams
from llmrpc.server import convert
from llmrpc.server.auth import fair_share_caller
from llmrpc.server.errors import InvalidArgument, handle_errors
from llmrpc.server.logs import current_request_id
from llmrpc.server.state import ServerState
from llmrpc.v1 import embedding_pb2, embedding_pb2_grpc

logger = logging.getLogger(__name__)

# Per call by default (--max-prompts-per-request), as vLLM's and OpenAI's embedding endpoints
MAX_INPUTS = DEFAULT_MAX_PROMPTS_PER_REQUEST
_INVALID_ARGUMENT = 3  # google.rpc.Code
_INTERNAL = 13


class EmbeddingServicer(embedding_pb2_grpc.EmbeddingServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    @handle_errors
    async def Embed(self, request, context):
        return await self._embed(request, context)

    async def _embed(self, request, context) -> embedding_pb2.EmbedResponse:
        """Embed, its errors raised as ``ServiceError``s (vLLM's engine service calls it too)."""
        engine = self.state.require_engine()
        model = self.state.model_name(request.model)
        self._check(request, engine.model_info)
        params = _params(request, _deadline(context))
        params.caller = fair_share_caller(context)
        admitted = self.state.admission.admit(engine, len(request.inputs))
        # The whole call's errors: engine stopped, an input dropped for the deadline...
        with admitted, convert.engine_errors(request):
            prompts = await self.state.tokenization.run(_tokenize_inputs, request)
            base_id = current_request_id() or "embed"
            results = await gather_or_cancel(
                *(
                    _embed_one(engine, f"{base_id}/{i}", i, kind, prompt, params)
                    for i, (kind, prompt) in enumerate(prompts)
                )
            )
        num_tokens = sum(r.num_prompt_tokens for r in results if not r.HasField("error"))
        usage = embedding_pb2.EmbedUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return embedding_pb2.EmbedResponse(results=results, usage=usage, model=model)

    def _check(self, request, model_info) -> None:
        if not request.inputs:
            raise InvalidArgument("inputs", "at least one input")
        admission = self.state.admission
        admission.check_prompts(len(request.inputs), "inputs")
        max_waiting = admission.max_waiting
        if max_waiting is not None and 0 < max_waiting < len(request.inputs):
            raise InvalidArgument(
                "inputs",
                f"at most {max_waiting} inputs on this server (--max-waiting-requests), "
                f"got {len(request.inputs)}",
            )
        size = model_info.embedding_size
        if request.HasField("dimensions") and not 1 <= request.dimensions <= size:
            raise InvalidArgument(
                "dimensions", f"must be in [1, {size}] (the model's embedding size)"
            )
        if request.HasField("truncate_prompt_tokens") and request.truncate_prompt_tokens < 1:
            raise InvalidArgument("truncate_prompt_tokens", "must be >= 1")


def _deadline(context) -> float | None:
    """The call's deadline on the engine's clock (``time.monotonic()``), if it has one: each
    input's engine request carries it, so one queued past hope is dropped before it is
    computed (as generation's are)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _params(request, deadline: float | None) -> SamplingParams:
    pooling = PoolingParams(
        normalize=request.normalize if request.HasField("normalize") else None,
        dimensions=request.dimensions if request.HasField("dimensions") else None,
    )
    truncate = (
        request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
    )
    return SamplingParams(
        max_tokens=None, truncate_prompt_tokens=truncate, pooling=pooling, deadline=deadline
    )


def _tokenize_inputs(tokenizer, request) -> list[tuple[str, list[int] | status_pb2.Status]]:
    """Each input's kind and token ids, or the Status of why it has none (on a tokenizer
    worker: tokenizing grows with the input)."""
    prompts = []
    for index, item in enumerate(request.inputs):
        kind = item.WhichOneof("input")
        if kind == "token_ids":
            prompts.append((kind, list(item.token_ids.ids)))
        elif kind is None:
            prompts.append(("", _invalid(f"inputs[{index}]", "set text or token_ids")))
        elif tokenizer is None:
            message = "needs a tokenizer; this server runs with --skip-tokenizer-init"
            prompts.append((kind, _invalid(f"inputs[{index}].text", message)))
        else:
            prompts.append((kind, _encode(tokenizer, item.text, request)))
    return prompts


def _encode(tokenizer, text: str, request) -> list[int]:
    """With truncate_prompt_tokens, vLLM's rule for text: the tokenizer keeps the text's last
    tokens and its special tokens ([CLS] ... [SEP] stay), N in all. (Token ids are cut by the
    engine: their last N.) The worker's tokenizer is its own, so its side may be set here."""
    if not request.HasField("truncate_prompt_tokens"):
        return tokenizer.encode(text, add_special_tokens=True)
    side, tokenizer.truncation_side = tokenizer.truncation_side, "left"
    try:
        limit = request.truncate_prompt_tokens
        return tokenizer.encode(text, add_special_tokens=True, truncation=True, max_length=limit)
    finally:
        tokenizer.truncation_side = side


async def _embed_one(engine, request_id: str, index: int, kind: str, prompt, params):
    result = embedding_pb2.EmbedResult(index=index)
    if isinstance(prompt, status_pb2.Status):
        result.error.CopyFrom(prompt)
        return result
    try:
        output = await engine.embed(request_id, prompt, params)
    except InvalidRequestError as error:
        result.error.CopyFrom(_invalid(_field(error.field, index, kind), error.message))
        return result
    except (EngineDeadError, EngineStateError):
        raise  # the whole call's: convert.engine_errors in the caller's handler
    if output.finish_reason is FinishReason.DEADLINE:  # dropped from the queue, not computed
        raise convert.DeadlineDropped  # the whole call's: its deadline cannot be met
    if output.error is not None:
        field = output.error_field
        if field is None:
            logger.error("embedding input %d failed in the engine: %s", index, output.error)
            result.error.CopyFrom(status_pb2.Status(code=_INTERNAL, message=output.error))
        else:
            result.error.CopyFrom(_invalid(_field(field, index, kind), output.error))
        return result
    result.embedding.extend(output.embedding)
    result.num_prompt_tokens = output.num_prompt_tokens
    return result


def _field(engine_field: str, index: int, kind: str) -> str:
    """An engine field as the request names it: "input" is the input's text or token ids."""
    return f"inputs[{index}].{kind}" if engine_field == "input" else engine_field


def _invalid(field: str, description: str) -> status_pb2.Status:
    violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return status_pb2.Status(
        code=_INVALID_ARGUMENT, message=f"{field}: {description}", details=[detail]
    )
