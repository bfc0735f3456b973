"""Multi-LoRA shrink and expand as segmented Triton matmuls (the twins are in
``kernel_ops/lora.py``).

The flat batch is cut into segments of rows that share a LoRA slot (``LoRABatch.seg_starts``,
``seg_slots``). A program owns one (segment, tile of ``BLOCK_M`` rows, tile of ``BLOCK_N``
columns): it reads its segment's slot, returns at once for a base-model segment (slot -1) or a
row tile past the segment's end, and otherwise multiplies its rows by that slot's weights. The
grid's row-tile axis is sized by ``max_seg_len``, so a long prefill segment spreads over many
programs and a decode row (a segment of one) costs one tile; no host sync.

Operands are loaded in the model dtype and fed to ``tl.dot`` in it (tensor cores on a GPU; IEEE
float32 for float32, as torch's matmul), accumulating in float32; the expand adds the bias and the
old output in float32 and rounds once at the store (to nearest even; ``_round`` makes the
interpreter, which truncates, do the same). ``DOT_F32`` upcasts bfloat16 dot operands where the
interpreter needs it (see ``triton_utils``). Each wrapper checks the layout contract before a
launch (``ValueError`` naming the argument). Unchecked, because reading them needs a host sync:
``seg_starts`` rises from 0 to ``T``, every slot in ``seg_slots`` is -1 or below ``S``, and
``max_seg_len`` is at least the longest segment with a slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmrpc.kernels.lora import LoRABatch
from llmrpc.kernels.triton_elementwise import _round
from llmrpc.kernels.triton_utils import check, check_device, dot_in_f32

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_RANK = 256  # R of the stacked weights: up to 3 slices (q, k, v) of rank 64, padded
_BLOCK_K = 64  # reduction tile of the shrink (over in_features)
_BLOCK_N = 64  # column tile of the expand (over out_features)


@triton.jit
def _segment_tile(seg_starts_ptr, seg_slots_ptr, BLOCK_M: tl.constexpr):
    """(slot, rows of this program's tile as int64, their mask, whether there is work)."""
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    first = start + tl.program_id(1) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    return slot.to(tl.int64), rows.to(tl.int64), rows < end, (slot >= 0) & (first < end)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, seg_starts_ptr, seg_slots_ptr,
    in_features, rank,
    stride_xt, stride_as, stride_ar, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    # h[rows, cols] = x[rows, :] @ a[slot, cols, :].T over the tile; h was zeroed by the wrapper.
    dtype: tl.constexpr = h_ptr.dtype.element_ty
    slot, rows, row_mask, work = _segment_tile(seg_starts_ptr, seg_slots_ptr, BLOCK_M)
    if work:
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < rank
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows[:, None] * stride_xt
        a_cols = a_ptr + slot * stride_as + cols[None, :] * stride_ar
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, in_features, BLOCK_K):
            ks = k + offs_k
            k_mask = ks < in_features
            x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if DOT_F32:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc += tl.dot(x, a, input_precision="ieee")
        h = _round(acc, dtype).to(dtype)
        mask = row_mask[:, None] & col_mask[None, :]
        tl.store(h_ptr + rows[:, None] * stride_ht + cols[None, :], h, mask=mask)


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, bias_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr,
    out_features, rank,
    stride_ht, stride_bs, stride_bn, stride_biass, stride_ot,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    # out[rows, cols] += h[rows, :] @ b[slot, cols, :].T (+ bias[slot, cols]), rounded once.
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    slot, rows, row_mask, work = _segment_tile(seg_starts_ptr, seg_slots_ptr, BLOCK_M)
    if work:
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < out_features
        offs_k = tl.arange(0, BLOCK_K)
        h_rows = h_ptr + rows[:, None] * stride_ht
        b_cols = b_ptr + slot * stride_bs + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, rank, BLOCK_K):
            ks = k + offs_k
            k_mask = ks < rank
            h = tl.load(h_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if DOT_F32:
                h = h.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(h, b, input_precision="ieee")
        if HAS_BIAS:
            bias = tl.load(bias_ptr + slot * stride_biass + cols, mask=col_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        out_tile = out_ptr + rows[:, None] * stride_ot + cols[None, :]
        old = tl.load(out_tile, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_tile, _round(old + acc, dtype).to(dtype), mask=mask)


def lora_shrink(x: torch.Tensor, a_stacked: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """``[T, R]`` in ``x``'s dtype: ``x [T, in] @ a_stacked[slot].T`` for the rows of each
    segment with a slot (``a_stacked [S, R, in]``); rows of slot -1 are 0."""
    _check_matrix("x", x, x.device)
    num_tokens, in_features = x.shape
    _check_stacked("a_stacked", a_stacked, x, (None, None, in_features), "[S, R, in_features]")
    rank = a_stacked.shape[1]
    check(1 <= rank <= MAX_RANK, f"a_stacked has rank {rank}, expected 1 to {MAX_RANK}")
    num_segments = _check_batch(batch, x.device)
    h = torch.zeros(num_tokens, rank, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_segments == 0:
        return h
    block_m = _block_m(batch.max_seg_len)
    block_n = max(16, min(64, triton.next_power_of_2(rank)))
    grid = (num_segments, triton.cdiv(batch.max_seg_len, block_m), triton.cdiv(rank, block_n))
    _shrink_kernel[grid](
        x, a_stacked, h, batch.seg_starts, batch.seg_slots,
        in_features, rank,
        x.stride(0), a_stacked.stride(0), a_stacked.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, DOT_F32=dot_in_f32(x.dtype),
    )  # fmt: skip
    return h


def lora_expand(
    h: torch.Tensor,
    b_stacked: torch.Tensor,
    batch: LoRABatch,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """In place: ``out[rows] += h[rows] @ b_stacked[slot].T`` (``b_stacked [S, out_features,
    R]``) ``+ bias[slot]`` (``bias [S, out_features]``) for the rows of each segment with a
    slot; rows of slot -1 untouched. ``out [T, out_features]`` may be a column slice (any row
    stride), contiguous in its last dimension."""
    _check_matrix("h", h, h.device)
    num_tokens, rank = h.shape
    check(1 <= rank <= MAX_RANK, f"h has rank {rank} columns, expected 1 to {MAX_RANK}")
    _check_stacked("b_stacked", b_stacked, h, (None, None, rank), "[S, out_features, R]")
    num_slots, out_features = b_stacked.shape[:2]
    _check_matrix("out", out, h.device)
    check(
        out.shape == (num_tokens, out_features),
        f"out has shape {tuple(out.shape)}, expected {(num_tokens, out_features)}",
    )
    check(out.dtype == h.dtype, f"out is {out.dtype}, h {h.dtype}")
    check(num_tokens <= 1 or out.stride(0) >= out_features, "out's rows must not overlap")
    if bias is not None:
        _check_stacked("bias", bias, h, (num_slots, out_features), "[S, out_features]")
    num_segments = _check_batch(batch, h.device)
    if num_tokens == 0 or num_segments == 0:
        return
    block_m = _block_m(batch.max_seg_len)
    block_k = max(16, min(64, triton.next_power_of_2(rank)))
    grid = (
        num_segments,
        triton.cdiv(batch.max_seg_len, block_m),
        triton.cdiv(out_features, _BLOCK_N),
    )
    _expand_kernel[grid](
        h, b_stacked, bias if bias is not None else b_stacked, out,
        batch.seg_starts, batch.seg_slots,
        out_features, rank,
        h.stride(0), b_stacked.stride(0), b_stacked.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=block_k,
        DOT_F32=dot_in_f32(h.dtype),
    )  # fmt: skip


def _block_m(max_seg_len: int) -> int:
    """Rows of a tile: 16 (``tl.dot``'s least) for decode segments, up to 64 for prefill."""
    return max(16, min(64, triton.next_power_of_2(max_seg_len)))


def _check_matrix(name: str, t: torch.Tensor, device: torch.device) -> None:
    check(t.dim() == 2, f"{name} must be 2-D [T, features], got shape {tuple(t.shape)}")
    check(t.dtype in DTYPES, f"{name} is {t.dtype}, expected one of {DTYPES}")
    check(t.shape[1] <= 1 or t.stride(1) == 1, f"{name} must be contiguous in its last dimension")
    check_device(name, t, device)


def _check_stacked(name, t, like, shape, form) -> None:
    """``t`` has ``like``'s dtype and device, ``shape`` (None: any), last dimension contiguous."""
    check(
        t.dim() == len(shape) and all(s in (None, n) for s, n in zip(shape, t.shape, strict=True)),
        f"{name} must be {form}, got shape {tuple(t.shape)}",
    )
    check(t.dtype == like.dtype, f"{name} is {t.dtype}, expected {like.dtype}")
    check(t.shape[-1] <= 1 or t.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    check_device(name, t, like.device)


def _check_batch(batch: LoRABatch, device: torch.device) -> int:
    """The number of segments, after checking ``batch``'s tensors and ``max_seg_len``."""
    slots = batch.seg_slots
    check(slots.dim() == 1, f"seg_slots must be [num_segments], got shape {tuple(slots.shape)}")
    num_segments = slots.shape[0]
    for name, t, length in (
        ("seg_starts", batch.seg_starts, num_segments + 1),
        ("seg_slots", slots, num_segments),
    ):
        check(t.dtype == torch.int32, f"{name} is {t.dtype}, expected torch.int32")
        check(t.shape == (length,), f"{name} has shape {tuple(t.shape)}, expected {(length,)}")
        check(t.is_contiguous(), f"{name} must be contiguous")
        check_device(name, t, device)
    check(
        batch.max_seg_len >= 1 or num_segments == 0,
        f"max_seg_len must be at least 1, got {batch.max_seg_len}",
    )
    return num_segments
