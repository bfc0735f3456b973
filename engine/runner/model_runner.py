"""Turns a scheduler step into flat tensors, runs the model, and returns logits to sample from."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from llmrpc.engine.models.llama import head_dim_of
from llmrpc.engine.pooling.pooler import PoolSpan, gather
from llmrpc.engine.request import Request
from llmrpc.engine.runner.compilation import CompiledDecode, why_not_compiled
from llmrpc.engine.runner.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphPlan,
    DecodeGraphs,
)
from llmrpc.engine.runner.device import HostStaging, kv_blocks_for_device_memory, model_device
from llmrpc.engine.runner.host_memory import PopulateAhead, host_zeros
from llmrpc.engine.sched.scheduler import SchedulerOutput
from llmrpc.kernels import cpu_ops
from llmrpc.kernels.attention import FP8_DTYPES, AttentionMetadata, PrefillSeq
from llmrpc.kernels.lora import LoRABatch

logger = logging.getLogger(__name__)

# Prompt chunks whose context is at most this long go through the decode kernel one token per
# row (32 prompts of 45 tokens: 1.7 ms a layer where one attention call per prompt took 3.7 ms);
# longer ones take a causal attention call per chunk, whose work grows as context squared.
_ROWS_AS_DECODES_MAX_CONTEXT = 256


def kv_cache_shape(hf_config, num_blocks: int, block_size: int) -> tuple[int, ...]:
    head_dim = head_dim_of(hf_config)
    num_kv_heads = getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads)
    return (num_blocks, block_size, num_kv_heads, head_dim)


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, keys and values."""
    elements = 1
    for dim in kv_cache_shape(hf_config, 1, block_size):
        elements *= dim
    return 2 * hf_config.num_hidden_layers * elements * dtype.itemsize


@dataclass
class PromptLogitsSpan:
    """Rows of prompt positions whose next token is also a prompt token (for prompt logprobs)."""

    request: Request
    first_position: int
    num_positions: int


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    # [num_sampled + prompt positions]: the last token of each request that samples, then
    # the prompt positions of each PromptLogitsSpan
    logits_indices: torch.Tensor
    sampled_requests: list[Request]
    prompt_spans: list[PromptLogitsSpan]
    # those of sampled_requests with drafts (spec_token_ids), whose draft rows follow the
    # sampled rows in logits_indices, in this order
    verified_requests: list[Request] = field(default_factory=list)
    lora_batch: LoRABatch | None = None  # the LoRA slot of each row; None: no adapted row
    pool_spans: list[PoolSpan] = field(default_factory=list)  # pooling requests' rows
    # the longest context of a decode row, for the CUDA graphs (0: none, or no graphs)
    max_decode_seq_len: int = 0


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [num_sampled, vocab_size] float32
    sampled_requests: list[Request]
    prompt_logits: list[tuple[PromptLogitsSpan, torch.Tensor]]  # [num_positions, vocab_size]
    pooled: list[Request] = field(default_factory=list)  # pooling requests computed whole
    # per request with drafts: [num_drafts, vocab_size], row j the logits after draft j
    draft_logits: dict[Request, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        hf_config,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,
        backend: str = "torch",
        batch_invariant: bool = False,
    ) -> None:
        self.model = model  # eager; compile_decode() adds a compiled forward for decode steps
        self._device = model_device(model)
        self.backend = backend  # --attention-backend, resolved: torch or triton
        # --batch-invariant: every token takes one attention path, whatever the batch
        self.batch_invariant = batch_invariant
        self.lora = None  # the engine's LoRAManager under --enable-lora
        self.parallel = None  # the engine's TensorParallel under --tensor-parallel-size > 1
        self._staging = HostStaging(self._device)
        self.block_size = block_size
        self._kv_shape = kv_cache_shape(hf_config, num_blocks, block_size)
        self._num_layers = hf_config.num_hidden_layers
        self._dtype = kv_cache_dtype
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._populate_wanted: Callable[[], int | None] | None = None  # populate_ahead's
        self._populating: PopulateAhead | None = None
        self.allocate_kv_cache()

    def allocate_kv_cache(self) -> None:
        # Zero-filled: masked-out slots of a gathered block must never hold NaN.
        shape, dtype = self._kv_shape, self._dtype
        if not getattr(self._model, "uses_kv_cache", True):  # an encoder: blocks are bookkeeping
            shape = (0,)
        device = self._device
        self.kv_caches = [
            (_zeros(shape, dtype, device), _zeros(shape, dtype, device))
            for _ in range(self._num_layers)
        ]
        self.kv_cache_bytes = sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
        if self._populate_wanted is not None:
            self.populate_ahead(self._populate_wanted)

    def populate_ahead(self, wanted: Callable[[], int | None]) -> None:
        """Fault in a host KV cache's first ``wanted()`` blocks off the step's path, and again
        after each reallocation (``host_memory.PopulateAhead``); nothing on a device."""
        self._populate_wanted = wanted
        self._stop_populating()  # one thread per cache
        if self._device.type == "cpu" and self.kv_caches:
            tensors = [tensor for pair in self.kv_caches for tensor in pair]
            self._populating = PopulateAhead(tensors, wanted)

    def _stop_populating(self) -> None:
        if self._populating is not None:
            self._populating.stop()
            self._populating = None

    def free_kv_cache(self) -> None:
        self._stop_populating()
        self.decode_graphs = None  # they hold the cache's addresses
        self.kv_caches = []
        self.kv_cache_bytes = 0

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Replace the KV cache with one of ``num_blocks`` blocks (at start-up, before requests)."""
        self.free_kv_cache()
        self._kv_shape = (num_blocks, *self._kv_shape[1:])
        self.allocate_kv_cache()

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_sampled: int) -> None:
        """The largest step the scheduler may make: one prompt chunk of ``num_tokens`` tokens
        with ``num_sampled`` rows of logits, so the device's peak memory can be measured. The
        KV cache must hold ``num_tokens`` tokens; what the step writes there is never read."""
        size, device = self.block_size, self._device
        blocks = torch.arange(-(-num_tokens // size), device=device)
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=device),
            decode_indices=torch.empty(0, dtype=torch.long, device=device),
            decode_block_tables=torch.empty(0, 0, dtype=torch.long, device=device),
            decode_seq_lens=torch.empty(0, dtype=torch.long, device=device),
            prefills=[]
            if self.backend == "triton"
            else [PrefillSeq(0, num_tokens, num_tokens, blocks)],
            backend=self.backend,
        )
        if self.backend == "triton":
            metadata.prefill_indices = torch.arange(num_tokens, device=device)
            metadata.prefill_query_start_loc = torch.tensor([0, num_tokens], device=device)
            metadata.prefill_seq_lens = torch.tensor([num_tokens], device=device)
            metadata.prefill_block_tables = blocks.unsqueeze(0)
            metadata.prefill_max_query_len = num_tokens
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device)
        if not getattr(self.model, "uses_kv_cache", True):  # an encoder: sequences it can embed
            positions %= self.model.config.max_position_embeddings
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        self.model.compute_logits(hidden[-min(num_sampled, num_tokens) :])

    def kv_blocks_on_device(self, num_tokens: int, num_sampled: int, utilization: float) -> int:
        """KV blocks for ``--gpu-memory-utilization`` on a CUDA device: what the largest step
        (``profile_run``) leaves of that share of its memory, for this runner's KV heads (a
        tensor-parallel rank's own). The KV cache is freed; ``resize_kv_cache`` makes it anew."""
        device = self._device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        self.profile_run(num_tokens, num_sampled)
        torch.cuda.synchronize(device)
        self.free_kv_cache()
        free, total = torch.cuda.mem_get_info(device)
        peak = torch.cuda.max_memory_allocated(device)
        other = total - free - torch.cuda.memory_reserved(device)
        block_bytes = 2 * self._num_layers * math.prod(self._kv_shape[1:]) * self._dtype.itemsize
        num_blocks = kv_blocks_for_device_memory(total, utilization, peak, other, block_bytes)
        logger.info(
            "%s memory: %.2f GiB in all, peak %.2f GiB in the profiled step of %d tokens, "
            "%.2f GiB outside torch: %d KV blocks",
            device,
            total / 2**30,
            peak / 2**30,
            num_tokens,
            other / 2**30,
            num_blocks,
        )
        return num_blocks

    @property
    def model(self) -> nn.Module | None:
        return self._model

    @model.setter
    def model(self, model: nn.Module | None) -> None:
        self._model = model
        self.compiled_decode: CompiledDecode | None = None  # it holds the replaced model
        self.decode_graphs: DecodeGraphs | None = None  # so do these, and its weights' addresses

    def compile_decode(self) -> bool:
        """Compile the model's forward for decodes-only steps and warm it up now (while no
        request holds a KV block); False where those steps run eager (the reason is logged)."""
        reason = why_not_compiled(self.model, self.backend)
        if reason is not None:
            logger.warning("decode steps run eager, not compiled: %s", reason)
            return False
        compiled = CompiledDecode(self.model, self.backend)
        if not compiled.warm_up(self.kv_caches, self.block_size):
            return False
        self.compiled_decode = compiled
        return True

    def capture_decode_graphs(self, plan: DecodeGraphPlan) -> bool:
        """Capture CUDA graphs of the model's forward for decodes-only steps at ``plan``'s
        batch sizes (while no request holds a KV block); False where those steps run eager (the
        reason is logged)."""
        self.decode_graphs = None
        capture = CudaGraphCapture(self._device)
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.block_size, plan, self.backend, capture,
            self.compiled_decode,
        )  # fmt: skip
        if not graphs.capture_all():
            return False
        self.decode_graphs = graphs
        return True

    @property
    def device(self) -> torch.device:
        """The device the model's weights are on (asleep at level 2, where they were)."""
        model = self.model  # the engine thread may drop or reload it meanwhile
        if model is not None:
            self._device = model_device(model)
        return self._device

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, block_ids: Callable[[str], list[int]]
    ) -> ModelOutput:
        """Run one step: logits of the requests that sample, and of prompt-logprob positions."""
        model_input = self.prepare_input(output, block_ids)
        metadata = model_input.metadata
        inputs = (model_input.input_ids, model_input.positions, self.kv_caches, metadata)
        if self.parallel is not None:  # the other ranks run this forward with their shards
            self.parallel.broadcast_step(*inputs[:2], metadata, model_input.logits_indices)
        if self.lora is not None:  # what the LoRA layers read during this forward
            self.lora.context.set_batch(model_input.lora_batch, len(model_input.input_ids))
        hidden = None
        if self.decode_graphs is not None and metadata.decodes_only:
            hidden = self.decode_graphs(  # None: run eager
                model_input.input_ids, model_input.positions, metadata,
                model_input.max_decode_seq_len,
            )  # fmt: skip
        if hidden is None and self.compiled_decode is not None and metadata.decodes_only:
            hidden = self.compiled_decode(*inputs)  # None: run eager
        if hidden is None:
            hidden = self.model(*inputs)
        pooled = gather(model_input.pool_spans, hidden)
        logits = self.model.compute_logits(hidden[model_input.logits_indices])
        num_sampled = len(model_input.sampled_requests)
        draft_logits, start = {}, num_sampled
        for request in model_input.verified_requests:
            num_drafts = len(request.spec_token_ids)
            draft_logits[request] = logits[start : start + num_drafts]
            start += num_drafts
        prompt_logits = []
        for span in model_input.prompt_spans:
            prompt_logits.append((span, logits[start : start + span.num_positions]))
            start += span.num_positions
        sampled = model_input.sampled_requests
        return ModelOutput(logits[:num_sampled], sampled, prompt_logits, pooled, draft_logits)

    def prepare_input(
        self, output: SchedulerOutput, block_ids: Callable[[str], list[int]]
    ) -> ModelInput:
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows, decode_tables, decode_lens = [], [], []
        prefills, logits_indices, sampled, prompt_rows, prompt_spans = [], [], [], [], []
        pool_spans = []
        draft_rows, verified = [], []
        triton = self.backend == "triton"
        # The C++ decode kernel takes short prompt chunks one token per row; Triton's prefill
        # kernel takes every chunk of the step in one call.
        fp8 = self._dtype in FP8_DTYPES  # the C++ decode kernel reads the model's dtype only
        fits = cpu_ops.loaded() and not triton and not fp8
        rows_as_decodes_max = _ROWS_AS_DECODES_MAX_CONTEXT if fits else 0
        prefill_rows, prefill_starts, prefill_lens, prefill_tables = [], [0], [], []
        prefill_max_query_len = 0
        longrope = getattr(self.model, "long_rope_from", None) is not None
        longest = 0  # the longest context of a row
        long_rows: list[bool] = []  # longrope: the rows of requests past its switch
        for request, num_new in output.scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            longest = max(longest, end)
            blocks = block_ids(request.request_id)
            row = len(input_ids)
            drafts = request.spec_token_ids  # verified after the last token, one row each
            input_ids.extend(request.all_token_ids[start:end])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            if longrope:
                long_rows += [request.rope_long] * num_new
            slots.extend(blocks[p // size] * size + p % size for p in range(start, end))
            if self.batch_invariant:
                # torch: every token a row of the C++ decode kernel; triton: every request
                # a sequence of the varlen prefill kernel (a decode is one of one row)
                as_decode = not triton
            else:
                # a verify step's rows too, where the C++ decode kernel takes them
                as_decode = num_new == 1 or end <= rows_as_decodes_max or (fits and bool(drafts))
            if as_decode:
                # each new token attends like a decode, to the context up to itself
                table = blocks[: -(-end // size)]
                decode_rows.extend(range(row, row + num_new))
                decode_tables.extend([table] * num_new)
                decode_lens.extend(range(start + 1, end + 1))
            elif triton:
                prefill_rows.extend(range(row, row + num_new))
                prefill_starts.append(prefill_starts[-1] + num_new)
                prefill_max_query_len = max(prefill_max_query_len, num_new)
                prefill_lens.append(end)
                prefill_tables.append(blocks[: -(-end // size)])
            else:
                block_tensor = torch.tensor(
                    blocks[: -(-end // size)], dtype=torch.long, device=self._device
                )
                prefills.append(PrefillSeq(row, row + num_new, end, block_tensor))
            if request.pooler_state is not None:
                pool_spans.append(PoolSpan(request, row, start, end))
            elif end == request.num_tokens + len(drafts):
                first = row + num_new - 1 - len(drafts)
                logits_indices.append(first)
                sampled.append(request)
                if drafts:  # the rows after each draft, sampled once it is accepted
                    draft_rows.extend(range(first + 1, first + 1 + len(drafts)))
                    verified.append(request)
            span = _prompt_logits_span(request, start, end)
            if span is not None:
                prompt_rows.extend(range(row, row + span.num_positions))
                prompt_spans.append(span)
        lora_batch = self._lora_batch(output)
        stage = self._staging.to_device
        metadata = AttentionMetadata(
            slot_mapping=stage("slot_mapping", slots),
            decode_indices=stage("decode_indices", decode_rows),
            decode_block_tables=stage("decode_block_tables", _pad_tables(decode_tables)),
            decode_seq_lens=stage("decode_seq_lens", decode_lens),
            prefills=prefills,
            decodes_only=len(decode_rows) == len(input_ids),  # rows are added in order
            backend=self.backend,
        )
        window = getattr(self.model, "min_sliding_window", None)
        metadata.past_window = window is not None and longest > window
        if longrope:
            metadata.rope_long_rows = stage("rope_long_rows", long_rows, torch.bool)
        if triton and prefill_rows:
            metadata.prefill_max_query_len = prefill_max_query_len
            metadata.prefill_indices = stage("prefill_indices", prefill_rows)
            metadata.prefill_query_start_loc = stage("prefill_query_start_loc", prefill_starts)
            metadata.prefill_seq_lens = stage("prefill_seq_lens", prefill_lens)
            metadata.prefill_block_tables = stage(
                "prefill_block_tables", _pad_tables(prefill_tables)
            )
        return ModelInput(
            input_ids=stage("input_ids", input_ids),
            positions=stage("positions", positions),
            metadata=metadata,
            logits_indices=stage("logits_indices", logits_indices + draft_rows + prompt_rows),
            sampled_requests=sampled,
            verified_requests=verified,
            prompt_spans=prompt_spans,
            lora_batch=lora_batch,
            pool_spans=pool_spans,
            # what the graphs' bucket choice reads (eager steps need no pass over the rows)
            max_decode_seq_len=max(decode_lens, default=0) if self.decode_graphs is not None else 0,
        )

    def _lora_batch(self, output: SchedulerOutput) -> LoRABatch | None:
        """Each row's LoRA slot (rows follow ``output.scheduled``); None: no adapted row."""
        if self.lora is None:
            return None
        row_slots = []
        for request, num_new in output.scheduled:
            row_slots += [self.lora.slot_of(request)] * num_new
        backend = "triton" if self.backend == "triton" else "torch"  # as attention's kernels
        return LoRABatch.from_row_slots(row_slots, self._device, backend)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; in host memory, zero pages on huge pages (``host_memory``)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return host_zeros(shape, dtype)


def _prompt_logits_span(request: Request, start: int, end: int) -> PromptLogitsSpan | None:
    """Positions in [start, end) that predict a prompt token, if the request wants logprobs."""
    if request.params.prompt_logprobs is None:
        return None
    last = min(end, request.num_prompt_tokens - 1)  # the last prompt position predicts output
    if last <= start:
        return None
    return PromptLogitsSpan(request, start, last - start)


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    # Padding points at block 0: its slots are read but masked out.
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).view(
        len(tables), width
    )
