"""The fused experts layer as two grouped-GEMM Triton launches (the twin and the contract are in
``kernel_ops/moe.py``).

A token's ``k`` slots make ``T*k`` (token, slot) pairs, pair ``p = t * k + j``. ``align_by_expert``
sorts the pairs by expert and pads each expert's run to a multiple of ``BLOCK_M``:

- ``sorted_pairs`` int32 ``[num_blocks * BLOCK_M]``: pair indices, each expert's pairs
  contiguous and in pair order, its run starting on a block boundary; ``T*k`` (the sentinel)
  where a run is padded and after the last run;
- ``block_experts`` int32 ``[num_blocks]``: the expert of each block, -1 past the last run.

``num_blocks = cdiv(T*k + E*(BLOCK_M - 1), BLOCK_M)`` is the most any routing can need, so every
shape depends on ``T``, ``k`` and ``E`` only: torch operations, no host sync, capturable in a
CUDA graph. Pairs of id -1 are left out of every block.

Then a program owns one (block of ``BLOCK_M`` pairs of one expert, tile of ``BLOCK_N`` output
columns); a block of -1 returns at once, and the sentinel rows of a block are masked:

1. ``_gate_up_kernel``: ``gate_up[p] = w13[e] @ hidden[p // k]`` into ``[T*k, 2I]`` (the
   hidden rows gathered in the load, never copied);
2. ``_down_kernel``: ``out_k[p] = w * (w2[e] @ (silu(gate) * up))`` into ``[T*k, H]``, the
   activation computed from ``gate_up`` as it is loaded, ``w`` the pair's routing weight;
3. ``out[t] = sum_j out_k[t * k + j]`` in float32 (torch), rounded once to the dtype.

Rounding follows the twin: ``gate_up``, the activation (after the SiLU and after the product)
and the down product are rounded to the dtype as torch's operations round them; the matmuls
accumulate in float32. The twin keeps the weighted product in float32 where this path rounds it
once more into ``out_k`` (in the dtype: half the memory of a float32 buffer). Operands go to
``tl.dot`` in the dtype (IEEE float32 for float32), upcast where the interpreter needs it
(``DOT_F32``, see ``triton_utils``); ``_round`` rounds to nearest even in the interpreter too.
``fused_experts`` checks the layout contract before a launch (``ValueError`` naming the
argument); ids at or above ``E`` are not checked (a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmrpc.kernels.triton_elementwise import _round
from llmrpc.kernels.triton_utils import check, check_device, dot_in_f32

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_N = 64  # output-column tile
_BLOCK_K = 64  # reduction tile


@triton.jit
def _block_pairs(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """(expert of this program's block as int64, its pairs as int64, their mask)."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pairs, pairs < num_pairs


@triton.jit(do_not_specialize=["num_pairs"])  # it changes step to step
def _gate_up_kernel(
    hidden_ptr, w13_ptr, gate_up_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, hidden_size, gate_up_size,
    stride_ht, stride_we, stride_wn, stride_gt,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    # gate_up[pairs, cols] = hidden[pairs // k, :] @ w13[expert, cols, :].T over the tile
    dtype: tl.constexpr = gate_up_ptr.dtype.element_ty
    expert, pairs, pair_mask = _block_pairs(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    if expert >= 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < gate_up_size
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = hidden_ptr + (pairs // TOP_K)[:, None] * stride_ht
        w_cols = w13_ptr + expert * stride_we + cols[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, hidden_size, BLOCK_K):
            ks = k + offs_k
            k_mask = ks < hidden_size
            x = tl.load(x_rows + ks[None, :], mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if DOT_F32:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, w, input_precision="ieee")
        mask = pair_mask[:, None] & col_mask[None, :]
        out = gate_up_ptr + pairs[:, None] * stride_gt + cols[None, :]
        tl.store(out, _round(acc, dtype).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    gate_up_ptr, w2_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, hidden_size, inter_size,
    stride_gt, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    # out[pairs, cols] = weight[pairs] * (silu(gate) * up)[pairs, :] @ w2[expert, cols, :].T
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    expert, pairs, pair_mask = _block_pairs(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    if expert >= 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < hidden_size
        offs_k = tl.arange(0, BLOCK_K)
        gate_rows = gate_up_ptr + pairs[:, None] * stride_gt
        w_cols = w2_ptr + expert * stride_we + cols[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, inter_size, BLOCK_K):
            ks = k + offs_k
            k_mask = ks < inter_size
            a_mask = pair_mask[:, None] & k_mask[None, :]
            gate = tl.load(gate_rows + ks[None, :], mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(gate_rows + inter_size + ks[None, :], mask=a_mask, other=0.0)
            silu = _round(gate * tl.sigmoid(gate), dtype)
            act = _round(silu * up.to(tl.float32), dtype)
            w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if DOT_F32:
                w = w.to(tl.float32)
            else:
                act = act.to(dtype)
            acc += tl.dot(act, w, input_precision="ieee")
        weight = tl.load(weights_ptr + pairs, mask=pair_mask, other=0.0)
        y = _round(acc, dtype) * weight[:, None]
        mask = pair_mask[:, None] & col_mask[None, :]
        out = out_ptr + pairs[:, None] * stride_ot + cols[None, :]
        tl.store(out, _round(y, dtype).to(dtype), mask=mask)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_experts)`` for ``topk_ids [T, k]`` (module docstring): torch
    operations of static shapes, no host sync."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    # [T*k] expert of each pair; dropped pairs (-1) in a bucket E of their own, sorted last
    ids = topk_ids.reshape(-1).long()
    ids = torch.where(ids < 0, num_experts, ids)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))  # bincount would sync on CUDA
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    run_starts = counts.cumsum(0) - counts  # where each expert's run starts, unpadded
    order = torch.argsort(ids, stable=True)  # [T*k]
    sorted_ids = ids[order]
    rank = torch.arange(num_pairs, device=device) - run_starts[sorted_ids]  # place in its run
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    length = num_blocks * block_m
    # dropped pairs all land in one spare slot past the end, cut off below
    kept = sorted_ids < num_experts
    starts = (padded_ends - padded)[sorted_ids.clamp(max=num_experts - 1)]
    dest = torch.where(kept, starts + rank, length)
    sorted_pairs = torch.full((length + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs[:length], block_experts.to(torch.int32)


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``[T, H]`` in ``hidden``'s dtype: ``moe.fused_experts`` on the Triton kernels. Weights
    contiguous in their last dimension; ``hidden`` too; any row strides."""
    _check(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_experts, gate_up_size = w13.shape[:2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(num_tokens, hidden_size)
    block_m = _block_m(num_pairs, num_experts)
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_experts.shape[0]
    weights = topk_weights.reshape(-1).float().contiguous()  # [T*k]
    dot_f32 = dot_in_f32(hidden.dtype)
    gate_up = hidden.new_empty(num_pairs, gate_up_size)
    _gate_up_kernel[(num_blocks, triton.cdiv(gate_up_size, _BLOCK_N))](
        hidden, w13, gate_up, sorted_pairs, block_experts,
        num_pairs, hidden_size, gate_up_size,
        hidden.stride(0), w13.stride(0), w13.stride(1), gate_up.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, DOT_F32=dot_f32,
    )  # fmt: skip
    out_k = hidden.new_zeros(num_pairs, hidden_size)  # dropped pairs stay 0
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, _BLOCK_N))](
        gate_up, w2, weights, out_k, sorted_pairs, block_experts,
        num_pairs, hidden_size, gate_up_size // 2,
        gate_up.stride(0), w2.stride(0), w2.stride(1), out_k.stride(0),
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, DOT_F32=dot_f32,
    )  # fmt: skip
    summed = out_k.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32)
    return summed.to(hidden.dtype)


def token_counts_for_every_block_m(num_experts: int, top_k: int) -> list[int]:
    """The fewest tokens whose step launches each ``BLOCK_M`` variant (16, 32, 64) of the
    kernels, for a start-up warm-up (engine/runner/kernel_warm_up.py)."""
    counts: dict[int, int] = {}  # block size -> the fewest pairs per expert that _block_m gives it
    for pairs in range(1, 65):
        counts.setdefault(_block_m(pairs * num_experts, num_experts), pairs)
    return [-(-pairs * num_experts // top_k) for pairs in counts.values()]


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Pairs per block: 16 (``tl.dot``'s least) when experts get a few pairs each (decode), up
    to 64 when they get many (prefill), so padding stays a small part of the work."""
    return max(16, min(64, triton.next_power_of_2(triton.cdiv(num_pairs, num_experts))))


def _check(hidden, w13, w2, topk_weights, topk_ids) -> None:
    """The layout contract beyond ``moe._check``'s shapes and dtypes."""
    check(hidden.dtype in DTYPES, f"hidden is {hidden.dtype}, expected one of {DTYPES}")
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        check(t.shape[-1] <= 1 or t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
        check_device(name, t, hidden.device)
    check_device("topk_ids", topk_ids, hidden.device)
    check_device("topk_weights", topk_weights, hidden.device)
