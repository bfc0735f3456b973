"""The Triton kernels' variants compiled at start-up rather than at a user's request, and the
folder Triton keeps them in.

Triton compiles a kernel the first time it is launched with a new variant: new constexprs, argument
types, or an integer argument it specialises on (1, a multiple of 16). On a GPU that compile takes
a second or more, and the request that needs it waits. The kernels take what changes from step to
step (token counts, table widths, the decode split count) as plain runtime arguments, so the steps
of one model need few variants: the KV store's, the decode kernels', one prefill kernel per tile
size, the elementwise kernels' of each call site, the sampling kernel's, and a MoE model's experts
kernels at each block size (a prefill long enough for each). ``warm_up_triton_kernels`` launches
each of them once, on CUDA with the triton backend, before the engine reports ready;
``triton_cache_dir`` keeps what Triton compiled in the model cache folder, so that a restart loads
it instead of compiling again. LoRA's kernels (``--enable-lora``) are not warmed up: they compile
at the first request with an adapter.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from llmrpc.engine.loading.loader import cache_root
from llmrpc.engine.models.transformers_impl import TransformersForCausalLM
from llmrpc.engine.runner.device import model_device
from llmrpc.kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)

TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
# Query lengths of the warm-up's prefill steps: with any group of query heads per KV head they
# reach every tile size of the prefill kernel (16, 32 and 64 rows of token x head).
_PREFILL_LENGTHS = (1, 2, 4, 8, 16, 32, 64)


def triton_cache_dir() -> Path:
    """``$TRITON_CACHE_DIR``, set to ``cache_root()/triton`` (``~/.cache/llmrpc/triton``)
    where it is unset, so that compiled kernels are kept with the converted models and
    inductor's cache. Triton reads the variable at each compile; set it before the first."""
    folder = os.environ.get(TRITON_CACHE_ENV)
    if not folder:
        folder = str(cache_root() / "triton")
        os.environ[TRITON_CACHE_ENV] = folder
    return Path(folder)


def warms_up_triton(
    model: nn.Module, backend: str, device: torch.device, tensor_parallel_size: int
) -> bool:
    """Whether start-up warms the Triton kernels up: on CUDA with the triton backend, for a
    native decoder, in one process (a tensor-parallel step needs every rank; those run eager)."""
    return (
        device.type == "cuda"
        and backend == "triton"
        and tensor_parallel_size == 1
        and not isinstance(model, TransformersForCausalLM)
        and getattr(model, "uses_kv_cache", True)
    )


@torch.inference_mode()
def warm_up_triton_kernels(
    model: nn.Module, kv_caches: list, block_size: int, max_query_len: int, max_model_len: int
) -> None:
    """Run the steps that launch every Triton kernel variant ``model``'s steps can need: a
    prefill step for each tile size (chunks of up to ``max_query_len`` tokens), a decodes-only
    step whose context takes several splits, and the sampling kernel on its logits. Every step
    stores nothing (each slot -1) and reads block 0 of the KV cache only; results are dropped."""
    from llmrpc.kernels import triton_sampling
    from llmrpc.kernels.triton_attention import blocks_per_iteration

    started = time.monotonic()
    device = model_device(model)
    lengths = sorted({*_PREFILL_LENGTHS, *_experts_lengths(model)})
    for num_tokens in (n for n in lengths if n <= min(max_query_len, max_model_len)):
        input_ids, positions, metadata = _prefill_step(num_tokens, block_size, device)
        model(input_ids, positions, kv_caches, metadata)
    width = 2 * blocks_per_iteration(block_size)  # two loop iterations: more than one split
    context = min(width * block_size, max_model_len)
    input_ids, positions, metadata = _decode_step(context, block_size, device)
    logits = model.compute_logits(model(input_ids, positions, kv_caches, metadata))
    # as engine/sample/sampler.py passes them: [rows, vocab] float32 scaled, int64 top_k, float32
    # rest
    ones = torch.ones(1, device=device)
    top_k = torch.zeros(1, dtype=torch.long, device=device)
    cutoff = torch.empty(1, device=device)
    scaled = logits / ones.unsqueeze(1)
    triton_sampling.sample(scaled, ones, top_k, ones, ones * 0.5, cutoff_out=cutoff)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("Triton kernels compiled or loaded in %.1f s", time.monotonic() - started)


def _experts_lengths(model: nn.Module) -> list[int]:
    """Prompt chunks that launch the fused experts' kernels at each of their block sizes."""
    from llmrpc.engine.models.moe import SparseMoeBlock
    from llmrpc.kernels.triton_moe import token_counts_for_every_block_m

    block = next((m for m in model.modules() if isinstance(m, SparseMoeBlock)), None)
    if block is None:
        return []
    return token_counts_for_every_block_m(block.experts.num_experts, block.top_k)


def _prefill_step(num_tokens: int, block_size: int, device: torch.device):
    """A prompt chunk of ``num_tokens`` tokens, every position in block 0, no slot written."""
    table = torch.zeros(1, -(-num_tokens // block_size), dtype=torch.long, device=device)
    metadata = _metadata(num_tokens, device, decodes_only=False)
    metadata.prefill_indices = torch.arange(num_tokens, device=device)
    metadata.prefill_query_start_loc = torch.tensor([0, num_tokens], device=device)
    metadata.prefill_seq_lens = torch.tensor([num_tokens], device=device)
    metadata.prefill_block_tables = table
    metadata.prefill_max_query_len = num_tokens
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    return input_ids, torch.arange(num_tokens, device=device), metadata


def _decode_step(context: int, block_size: int, device: torch.device):
    """One decode row over ``context`` positions, all in block 0, no slot written."""
    metadata = _metadata(1, device, decodes_only=True)
    width = -(-context // block_size)
    metadata.decode_indices = torch.zeros(1, dtype=torch.long, device=device)
    metadata.decode_block_tables = torch.zeros(1, width, dtype=torch.long, device=device)
    metadata.decode_seq_lens = torch.tensor([context], device=device)
    input_ids = torch.zeros(1, dtype=torch.long, device=device)
    return input_ids, torch.tensor([context - 1], device=device), metadata


def _metadata(num_tokens: int, device: torch.device, decodes_only: bool) -> AttentionMetadata:
    empty = torch.empty(0, dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
        decode_indices=empty,
        decode_block_tables=empty.view(0, 0),
        decode_seq_lens=empty,
        prefills=[],
        decodes_only=decodes_only,
        padded=True,
        backend="triton",
    )
