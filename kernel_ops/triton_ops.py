"""The Triton kernels a decode step runs, as torch operations (``torch.ops.llmrpc_triton``).

``torch.compile`` cannot trace a wrapper's launch (its layout checks, grid sizes, the interpreter
on the CPU). Registered as operations with shape-only ("fake") versions, each kernel is one node
of the compiled graph, whatever the device; inductor compiles the rest of the step around them.
The functions here are what the dispatchers (``kernel_ops/attention.py``,
``kernel_ops/elementwise.py``) call on the Triton backend: the operation while torch.compile traces,
the wrapper itself in an eager step, which so pays no dispatcher overhead.

The in-place kernels (``store_kv``, ``add_rms_norm``) are declared as mutating their outputs, so
the compiled graph writes the KV cache and the residual where eager does, with no copy.
"""

from __future__ import annotations

import torch

from llmrpc.kernels import triton_attention, triton_elementwise

_NAMESPACE = "llmrpc_triton"


@torch.library.custom_op(f"{_NAMESPACE}::store_kv", mutates_args=("key_cache", "value_cache"))
def _store_kv_op(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    triton_attention.store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


@_store_kv_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    return None


@torch.library.custom_op(f"{_NAMESPACE}::decode_attention", mutates_args=())
def _decode_attention_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    return triton_attention.decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale,
        k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap,
    )  # fmt: skip


@_decode_attention_op.register_fake
def _(
    query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, window=0,
    softcap=0.0,
):  # fmt: skip
    return query.new_empty(query.shape)  # [num_seqs, num_heads, head_dim], contiguous


@torch.library.custom_op(f"{_NAMESPACE}::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return triton_elementwise.rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_NAMESPACE}::add_rms_norm", mutates_args=("x", "residual"))
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    triton_elementwise.add_rms_norm(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps) -> None:
    return None


@torch.library.custom_op(f"{_NAMESPACE}::rotary", mutates_args=())
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return triton_elementwise.rotary(x, cos, sin)


@_rotary_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


def store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    """``triton_attention.store_kv``."""
    if torch.compiler.is_compiling():
        _store_kv_op(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    else:
        triton_attention.store_kv(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
        )


def decode_attention(
    query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, window=0,
    softcap=0.0,
) -> torch.Tensor:  # fmt: skip
    """``triton_attention.decode_attention`` with its default split count."""
    if torch.compiler.is_compiling():
        return _decode_attention_op(
            query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
            window, softcap,
        )  # fmt: skip
    return triton_attention.decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale,
        k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap,
    )  # fmt: skip


def rms_norm(x, weight, eps) -> torch.Tensor:
    """``triton_elementwise.rms_norm``."""
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, eps)
    return triton_elementwise.rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_elementwise.add_rms_norm``: in place, returning ``(x, residual)``."""
    if torch.compiler.is_compiling():
        _add_rms_norm_op(x, residual, weight, eps)
        return x, residual
    return triton_elementwise.add_rms_norm(x, residual, weight, eps)


def rotary(x, cos, sin) -> torch.Tensor:
    """``triton_elementwise.rotary``."""
    if torch.compiler.is_compiling():
        return _rotary_op(x, cos, sin)
    return triton_elementwise.rotary(x, cos, sin)
