"""The decoder layer's elementwise steps as Triton kernels: RMS norm, add + RMS norm, rotary.

Each kernel rounds where its torch twin in ``kernel_ops/elementwise.py`` rounds (the dtype of ``x``
after every torch operation), computing in float32 in between; each wrapper checks the layout
contract before the launch (``ValueError`` naming the argument). A program holds whole rows (whole
tokens for rotary), each in a block of the next power of two, masked at the end: many short rows
to a program, one long one.

Rounding to bfloat16 is done by hand (``_round``): Triton's interpreter converts float32 to
bfloat16 by truncation, not to nearest even as torch and the GPU do; rounding the float32 bits
first makes the later conversion exact on both, so the interpreter checks the GPU's arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmrpc.kernels.triton_utils import check, check_device

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to nearest even in ``dtype``, held in float32."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16  # finite values only
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit(do_not_specialize=["num_rows"])  # it changes step to step
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    weight_ptr,
    eps,
    num_rows,
    hidden,
    inner,  # rows of x per index of its first dimension (heads of a 3-D x, else 1)
    x_stride0,
    x_stride1,
    residual_stride0,
    residual_stride1,
    out_stride0,
    out_stride1,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    outer, sub = (row // inner).to(tl.int64), (row % inner).to(tl.int64)
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < num_rows) & (cols < hidden)
    x = tl.load(x_ptr + outer * x_stride0 + sub * x_stride1 + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        # the whole row is read before anything is written: out may be x, residual is rewritten
        residual_row = residual_ptr + outer * residual_stride0 + sub * residual_stride1 + cols
        x = _round(x + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(residual_row, x.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)[:, None]
    weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    y = _round(weight * _round(x * rstd, dtype), dtype)
    tl.store(out_ptr + outer * out_stride0 + sub * out_stride1 + cols, y.to(dtype), mask=mask)


@triton.jit(do_not_specialize=["tokens"])  # it changes step to step
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    tokens,
    heads,
    half,
    x_stride0,
    x_stride1,
    cos_stride0,
    sin_stride0,
    out_stride0,
    out_stride1,
    TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    token = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)[:, None, None]  # [TOKENS, 1, 1]
    head = tl.arange(0, BLOCK_H)[None, :, None]
    col = tl.arange(0, BLOCK_D)[None, None, :]  # a column of the first half
    col_mask = (token < tokens) & (col < half)
    mask = (head < heads) & col_mask
    token = token.to(tl.int64)
    x_row = x_ptr + token * x_stride0 + head * x_stride1 + col
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half, mask=mask, other=0.0).to(tl.float32)
    cos_row = cos_ptr + token * cos_stride0 + col
    sin_row = sin_ptr + token * sin_stride0 + col
    cos1 = tl.load(cos_row, mask=col_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + half, mask=col_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + half, mask=col_mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1]; each product rounded, then
    # the sum (round(-a) = -round(a), so subtracting the rounded x2 * sin1 is the twin's sum).
    out1 = _round(_round(x1 * cos1, dtype) - _round(x2 * sin1, dtype), dtype)
    out2 = _round(_round(x2 * cos2, dtype) + _round(x1 * sin2, dtype), dtype)
    out_row = out_ptr + token * out_stride0 + head * out_stride1 + col
    tl.store(out_row, out1.to(dtype), mask=mask)
    tl.store(out_row + half, out2.to(dtype), mask=mask)


def _check_rows(name: str, t: torch.Tensor, dims: tuple[int, ...], device: torch.device) -> None:
    """``t`` has one of ``dims`` dimensions, a dtype of ``DTYPES``, a contiguous last dimension."""
    expected = " or ".join(f"{d}-D" for d in dims)
    check(t.dim() in dims, f"{name} has shape {tuple(t.shape)}, expected {expected}")
    check(t.shape[-1] > 0, f"{name} has an empty last dimension")
    check(t.dtype in DTYPES, f"{name} has dtype {t.dtype}, expected one of {DTYPES}")
    check(t.stride(-1) == 1 or t.shape[-1] == 1, f"{name}'s last dimension is not contiguous")
    check_device(name, t, device)


def _check_like(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """``t`` has ``x``'s shape, dtype and device, and a contiguous last dimension."""
    check(t.shape == x.shape, f"{name} has shape {tuple(t.shape)}, expected {tuple(x.shape)}")
    check(t.dtype == x.dtype, f"{name} has dtype {t.dtype}, expected {x.dtype} (x's)")
    _check_rows(name, t, (x.dim(),), x.device)


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    check(
        weight.shape == x.shape[-1:],
        f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)",
    )
    check(weight.dtype == x.dtype, f"weight has dtype {weight.dtype}, expected {x.dtype} (x's)")
    check(weight.is_contiguous(), "weight is not contiguous")
    check_device("weight", weight, x.device)


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    """Strides of the row dimensions of a 2-D (``[rows, hidden]``) or 3-D tensor."""
    return (t.stride(0), 0) if t.dim() == 2 else (t.stride(0), t.stride(1))


def _rows_per_program(row_elements: int) -> int:
    """Rows one program takes: a tile of up to 4096 elements (many short rows per program,
    one long row each), at most 64 rows."""
    return max(1, min(64, 4096 // row_elements))


def _launch_rms_norm(x, residual, out, weight, eps) -> None:
    rows = x.shape[:-1].numel()
    if rows == 0:
        return
    has_residual = residual is not None
    block = triton.next_power_of_2(x.shape[-1])
    rows_per_program = _rows_per_program(block)
    _rms_norm_kernel[(triton.cdiv(rows, rows_per_program),)](
        x,
        residual if has_residual else x,
        out,
        weight,
        float(eps),
        rows,
        x.shape[-1],
        1 if x.dim() == 2 else x.shape[1],
        *_row_strides(x),
        *_row_strides(residual if has_residual else x),
        *_row_strides(out),
        HAS_RESIDUAL=has_residual,
        ROWS=rows_per_program,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
        enable_fp_fusion=False,  # no fused multiply-adds: round where the twin rounds
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``rms_norm_torch(x, weight, eps)`` for ``x`` ``[rows, hidden]`` or ``[rows, heads,
    head_dim]`` (normalised over the last dimension; rows may be strided), ``weight`` ``[last
    dim]`` in ``x``'s dtype. Written to ``out`` (``x``'s shape and dtype) where given."""
    _check_rows("x", x, (2, 3), x.device)
    _check_weight(weight, x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        _check_like("out", out, x)
    _launch_rms_norm(x, None, out, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm_torch(x + residual), x + residual)``, the sum rounded to the dtype, in place:
    the sum is written into ``residual``'s memory and the normed rows into ``x``'s, and the two
    are returned as ``(x, residual)``. Shapes as for ``rms_norm``; ``residual`` like ``x``."""
    _check_rows("x", x, (2, 3), x.device)
    _check_like("residual", residual, x)
    _check_weight(weight, x)
    _launch_rms_norm(x, residual, x, weight, eps)
    return x, residual


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``rotary_torch(x, cos, sin)``: rotate-half rotary embedding of ``x`` ``[tokens, heads,
    head_dim]`` (any strides but a contiguous last dimension: a slice of a fused qkv projection
    will do) by ``cos``/``sin`` ``[tokens, 1, head_dim]`` in ``x``'s dtype. Written to ``out``
    (``x``'s shape and dtype) where given, which may be ``x`` itself."""
    _check_rows("x", x, (3,), x.device)
    check(x.shape[-1] % 2 == 0, f"x has head_dim {x.shape[-1]}, expected an even one")
    expected = (x.shape[0], 1, x.shape[2])
    for name, t in (("cos", cos), ("sin", sin)):
        check(t.shape == expected, f"{name} has shape {tuple(t.shape)}, expected {expected}")
        check(t.dtype == x.dtype, f"{name} has dtype {t.dtype}, expected {x.dtype} (x's)")
        _check_rows(name, t, (3,), x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        _check_like("out", out, x)
    tokens, heads, head_dim = x.shape
    if tokens == 0:
        return out
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim // 2)
    tokens_per_program = _rows_per_program(block_h * block_d)
    _rotary_kernel[(triton.cdiv(tokens, tokens_per_program),)](
        x,
        cos,
        sin,
        out,
        tokens,
        heads,
        head_dim // 2,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        TOKENS=tokens_per_program,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        enable_fp_fusion=False,  # x * cos + rotated * sin as two rounded products, then the sum
    )
    return out
