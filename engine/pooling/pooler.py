"""The engine side of pooling: a pooling request's hidden rows become its embedding.

A pooling request is a ``Request`` that never samples: the scheduler computes its prompt like any
prefill (chunked, beside generating requests), the model runner hands its hidden rows (after the
model's last norm) to its ``PoolerState`` instead of computing logits, and it finishes when its
prompt is computed. LAST needs only the prompt's last row; MEAN and CLS every row, so their
requests take no prefix-cache hit (``needs_every_row``) and a chunked prompt adds up across
chunks. An encoder (``engine/models/bert.py``) takes each sequence whole, in one step.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch.nn import functional

from llmrpc.engine.config import SchedulerConfig
from llmrpc.engine.core_types import EngineStateError
from llmrpc.engine.pooling.params import (
    PoolerConfig,
    PoolingParams,
    is_encoder,
    model_pooler_config,
    resolve_runner,
    sentence_transformers_max_len,
)
from llmrpc.engine.request import FinishReason, InvalidRequestError, Request, SamplingParams

logger = logging.getLogger(__name__)


class PoolerState:
    """One request's pooler and what it has gathered of its prompt's hidden rows."""

    def __init__(self, params: PoolingParams, needs_every_row: bool) -> None:
        self.pooling_type = params.pooling_type
        self.normalize = params.normalize
        self.dimensions = params.dimensions
        self.needs_every_row = needs_every_row
        self.pooled: torch.Tensor | None = None  # [hidden_size] float32: a sum, or the row

    def add(self, rows: torch.Tensor, start: int, end: int, num_tokens: int) -> None:
        """``rows`` [end - start, hidden_size]: the hidden states of positions [start, end)."""
        if start == 0:  # the prompt from its start again (a first chunk, or after preemption)
            self.pooled = None
        if self.pooling_type == "MEAN":
            total = rows.float().sum(dim=0)
            self.pooled = total if self.pooled is None else self.pooled + total
        elif self.pooling_type == "CLS" and start == 0:
            self.pooled = rows[0].float()
        elif self.pooling_type == "LAST" and end == num_tokens:
            self.pooled = rows[-1].float()

    def embedding(self, num_tokens: int) -> list[float]:
        vector = self.pooled / num_tokens if self.pooling_type == "MEAN" else self.pooled
        if self.dimensions is not None:  # Matryoshka: the leading values, then normalized
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = functional.normalize(vector, dim=0)
        return vector.tolist()


@dataclass
class PoolSpan:
    """Rows [row, row + end - start) of a step's hidden states: positions [start, end)."""

    request: Request
    row: int
    start: int
    end: int


def gather(spans: list[PoolSpan], hidden: torch.Tensor) -> list[Request]:
    """Give each span's rows to its pooler; the requests whose prompt is now computed."""
    done = []
    for span in spans:
        request = span.request
        rows = hidden[span.row : span.row + span.end - span.start]
        request.pooler_state.add(rows, span.start, span.end, request.num_tokens)
        if span.end == request.num_tokens:
            done.append(request)
    return done


class EnginePooling:
    """What the engine core knows of pooling for its model: the runner it is (``generate`` or
    ``pooling``), whether the model is an encoder, and its pooler defaults."""

    def __init__(self, model_config, hf_config, model_dir) -> None:
        architectures = getattr(hf_config, "architectures", None) or []
        self.encoder = is_encoder(architectures)
        self.runner = resolve_runner(
            model_config.runner, model_config.convert, model_config.task, architectures
        )
        self.config: PoolerConfig = model_pooler_config(
            model_dir, self.encoder, model_config.override_pooler_config
        )
        self.hidden_size = hf_config.hidden_size
        self.model_dir = model_dir
        logger.info(
            "runner %s; pooling %s%s",
            self.runner,
            self.config.pooling_type,
            ", normalized" if self.config.normalize else "",
        )

    def max_model_len(self, resolved: int, requested: int | None) -> int:
        """A pooling model's context, unless --max-model-len gives one: at most the length its
        sentence-transformers config cuts inputs to (as vLLM reads it), so an embedding is the
        one sentence-transformers makes, and a longer input is refused rather than cut."""
        limit = sentence_transformers_max_len(self.model_dir)
        if requested is not None or self.runner != "pooling" or limit is None or limit >= resolved:
            return resolved
        logger.info("context %d tokens: sentence_bert_config.json's max_seq_length", limit)
        return limit

    def scheduler_config(self, config: SchedulerConfig, max_model_len: int) -> SchedulerConfig:
        """An encoder attends over its whole sequence at once: no chunked prefill."""
        if not self.encoder:
            return config
        if config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"--max-num-batched-tokens {config.max_num_batched_tokens} is smaller than "
                f"--max-model-len {max_model_len}: an encoder takes each sequence whole in one "
                "step"
            )
        return dataclasses.replace(config, enable_chunked_prefill=False)

    def kv_blocks(self, num_blocks: int, max_num_seqs: int, max_model_len: int, size: int) -> int:
        """An encoder's KV blocks are bookkeeping only (it keeps no cache): as many as a full
        batch of full contexts needs, not as many as the memory would hold."""
        if not self.encoder:
            return num_blocks
        return min(num_blocks, max_num_seqs * -(-max_model_len // size))

    def check(self, params: SamplingParams) -> None:
        """Refuse generation on a pooling runner; check a pooling request's own fields."""
        if params.pooling is None:
            if self.runner == "pooling":
                what = "an encoder-only model" if self.encoder else "--runner pooling"
                raise EngineStateError(
                    f"this server makes embeddings ({what}); it does not generate text"
                )
            return
        params.pooling.validate(self.hidden_size)
        if params.n != 1:
            raise InvalidRequestError("n", "a pooling request has one result")

    def attach(self, requests: list[Request], params: SamplingParams) -> None:
        """Give each pooling request its pooler, the model's defaults filled in."""
        pooling = params.pooling
        resolved = PoolingParams(
            pooling.pooling_type or self.config.pooling_type,
            self.config.normalize if pooling.normalize is None else pooling.normalize,
            pooling.dimensions,
        )
        every_row = self.encoder or resolved.pooling_type != "LAST"
        for request in requests:
            request.pooler_state = PoolerState(resolved, every_row)

    @staticmethod
    def finish(scheduler, make_output, pooled: list[Request], failed: dict) -> list:
        """End the requests whose prompt this step completed, each with its embedding
        (``make_output``: the engine's output of a request, an error output if that fails)."""
        outputs = []
        for request in pooled:
            if request in failed or request.is_finished:
                continue
            try:
                embedding = request.pooler_state.embedding(request.num_tokens)
            except Exception as error:  # noqa: BLE001 - this request's own fault
                failed[request] = f"pooling failed: {error!r}"
                continue
            scheduler.finish_request(request, FinishReason.LENGTH)
            output = make_output(request, [])
            if output.error is None:
                output.embedding = embedding
            outputs.append(output)
        return outputs
