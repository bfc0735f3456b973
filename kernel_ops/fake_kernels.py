"""Shape-only ("fake") versions of the C++ kernels' operations (``kernel_ops/csrc``).

``torch.compile`` traces the model with fake tensors, which have shapes and dtypes but no data;
for an operation of ours it needs to be told what comes out. Each function here says just that.
The in-place operations (``fused_add_rms_norm``, ``rotary``) return nothing: their schemas mark
the tensors they write (as ``decode_attention_qkv``'s mark the KV caches it stores in).
"""

from __future__ import annotations

import threading

import torch

from llmrpc.kernels import cpu_ops

_lock = threading.Lock()
_registered: set[str] = set()


def register_fake_kernels() -> bool:
    """Register the fake operations (once); False where the kernels are not loaded, or an
    operation torch.compile would meet has none (``missing_fake_kernels``)."""
    if not cpu_ops.loaded():
        return False
    with _lock:
        for name, fake in _FAKES.items():
            if name not in _registered and hasattr(torch.ops.llmrpc_cpu, name):
                torch.library.register_fake(f"llmrpc_cpu::{name}", fake)
                _registered.add(name)
    return not missing_fake_kernels()


def missing_fake_kernels() -> list[str]:
    """The loaded operations that torch.compile could not trace: the ones without a fake."""
    return [name for name in _FAKES if name not in _registered]


def _decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):
    return torch.empty_like(query)  # [num_tokens, num_heads, head_dim]


def _decode_attention_qkv(
    qkv, cos, sin, key_cache, value_cache, slot_mapping, block_tables, seq_lens, num_heads, scale
):
    return qkv.new_empty((qkv.shape[0], num_heads, key_cache.shape[-1]))


def _decode_layer(hidden, residual, first, input_norm, post_norm, eps, linears, meta, *attention):
    return torch.empty_like(hidden)  # the mlp's output: [num_tokens, hidden]


def _rms_norm(x, weight, eps):
    return torch.empty_like(x)


def _fused_add_rms_norm(x, residual, weight, eps) -> None:
    return None


def _silu_and_mul(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _rotary(x, cos, sin) -> None:
    return None


def _int4_linear(x, weight, scales_zeros, tiles_from=0):
    return x.new_empty((x.shape[0], weight.shape[0] * 16))  # weight: [out / 16, in / 32, 8, 32]


def _q8_linear(x, weight, scales, zeros=False, tiles_from=0):
    return x.new_empty((x.shape[0], weight.shape[0] * 16))


def _quantized_rows(weight, scales, ids, zeros=False):
    return scales.new_empty(
        (ids.shape[0], weight.shape[1] * 32)
    )  # weight: [out / 16, in / 32, ...]


def _bf16_linear(x, weight, bias, kernel_by_bucket=()):
    return x.new_empty((x.shape[0], weight.shape[0] * 16))  # weight: [out / 16, in / 2, 16, 2]


def _packed_linear(x, packed_weight, bias):
    return x.new_empty((x.shape[0], packed_weight.shape[0]))  # [rows, out_features]


_FAKES = {
    "decode_attention": _decode_attention,
    "decode_attention_qkv": _decode_attention_qkv,
    "decode_layer": _decode_layer,
    "rms_norm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "silu_and_mul": _silu_and_mul,
    "rotary": _rotary,
    "packed_linear": _packed_linear,
    "int4_linear": _int4_linear,
    "q8_linear": _q8_linear,
    "quantized_rows": _quantized_rows,
    "bf16_linear": _bf16_linear,
}
