"""The decoder layer's elementwise steps: one fused C++ pass each
(``kernel_ops/csrc/elementwise.cpp``) where the kernels are loaded, else the torch operations they
replace (which the tests hold them to).
With ``backend="triton"`` (``--attention-backend``) the norms and rotary run the Triton kernels
of ``kernel_ops/triton_elementwise.py`` instead.

The torch versions round where a model written in the dtype rounds (after every operation), as
Transformers' Llama does, and the kernels round at the same places.
"""

from __future__ import annotations

import torch

from llmrpc.kernels import cpu_ops

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused(x: torch.Tensor) -> bool:
    return cpu_ops.loaded() and x.device.type == "cpu" and x.dtype in _DTYPES


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch"
) -> torch.Tensor:
    if backend == "triton":
        from llmrpc.kernels import triton_ops

        return triton_ops.rms_norm(x, weight, eps)
    if _fused(x) and weight.dtype == x.dtype:
        return torch.ops.llmrpc_cpu.rms_norm.default(x.contiguous(), weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; the kernels reuse both tensors' memory."""
    if backend == "triton":
        from llmrpc.kernels import triton_ops

        return triton_ops.add_rms_norm(x, residual, weight, eps)
    if _fused(x) and weight.dtype == x.dtype and x.is_contiguous() and residual.is_contiguous():
        torch.ops.llmrpc_cpu.fused_add_rms_norm.default(x, residual, weight, eps)
        return x, residual
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension."""
    if _fused(x):
        return torch.ops.llmrpc_cpu.silu_and_mul.default(x.contiguous())
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "torch"
) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` ``[tokens, heads, head_dim]`` by ``cos``/``sin``
    ``[tokens, 1, head_dim]``. The kernel rotates ``x`` in place: use the result, not ``x``."""
    if backend == "triton":
        from llmrpc.kernels import triton_ops

        return triton_ops.rotary(x, cos, sin)
    dense_heads = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    if _fused(x) and dense_heads and cos.dtype == x.dtype and cos.is_contiguous():
        torch.ops.llmrpc_cpu.rotary.default(x, cos, sin.contiguous())
        return x
    return rotary_torch(x, cos, sin)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
