"""``--quantization gguf``: a .gguf model's Q4_0, Q4_1 and Q8_0 tensors served from their own
blocks (see ``quantize_model_from_gguf``), packed as ``layers``' int4 and Q8_0 layers; its other
tensors stay as dequantized at load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from llmrpc.engine.quantization.layers import (
    Int4Linear,
    Q8BlockLinear,
    Q8Linear,
    QuantizedLinear,
    _replace,
    blocked_kernel_available,
    release_freed_memory,
)
from llmrpc.kernels.linear import RowsEmbedding

logger = logging.getLogger(__name__)

# GGUF tensor name (after "blk.N.") -> (our module under layers.N, shard index in a fused one)
_GGUF_LAYER_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the GGML types served from their blocks


@dataclass
class _Blocks:
    """One GGUF tensor's blocks as arrays over ``[rows, in]`` (rows: the outputs)."""

    type_name: str
    codes: np.ndarray  # Q4_x: uint8 in [0, 15]; Q8_0: int8
    scales: np.ndarray  # float32 [rows, in / 32]: d
    zeros: np.ndarray | None  # float32 [rows, in / 32]: Q4_x's w at code 8; None for Q8_0

    def permuted(self, order: np.ndarray) -> _Blocks:
        zeros = None if self.zeros is None else self.zeros[order]
        return _Blocks(self.type_name, self.codes[order], self.scales[order], zeros)


def read_blocks(tensor) -> _Blocks:
    """Decode a Q4_0, Q4_1 or Q8_0 tensor of a ``gguf.GGUFReader`` to codes, scales, zeros.

    Q4_0: 2-byte f16 d, 16 bytes of nibbles (low: elements 0-15, high: 16-31), w = d * (u - 8).
    Q4_1: d, f16 m, nibbles, w = d * u + m = (u - 8) * d + (m + 8 d).
    Q8_0: d, 32 int8 q, w = d * q.
    """
    name = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    rows = data.shape[0]
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[name]
    blocks = data.reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return _Blocks(name, q, d, None)
    offset = 2 if name == "Q4_0" else 4
    nibbles = blocks[..., offset:]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, -1)
    if name == "Q4_0":
        zeros = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + 8 * d
    return _Blocks(name, codes, d, zeros)


def _reverse_permute_order(rows: int, num_heads: int) -> np.ndarray:
    """The row order undoing llama.cpp's rotary permutation of q/k (as Transformers' GGUF
    loader undoes it for the llama architecture)."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(rows)


def quantize_model_from_gguf(
    model: nn.Module, gguf_path: Path, hf_config, dtype: torch.dtype
) -> nn.Module:
    """Swap the linear layers (and a tied or Q8_0 embedding) of a native Llama-family model for
    packed ones built from the GGUF file's own Q4_0/Q4_1/Q8_0 blocks.

    A fused layer (qkv_proj, gate_up_proj) is packed when all its parts are Q4_x (int4), or all
    Q8_0; otherwise, like every tensor of another type (F16, K-quants...), it keeps the weights
    already loaded (the file dequantized). Call it before ``model.to(dtype)``.
    """
    import gguf  # only for a .gguf file

    if not hasattr(model, "layers") or not hasattr(model, "embed_tokens"):
        raise ValueError(
            "--quantization gguf serves native Llama-family models (Llama, Mistral, SmolLM2, "
            "Qwen2, Qwen3); use --model-impl auto or vllm"
        )
    reader = gguf.GGUFReader(str(gguf_path))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    parts: dict[str, dict[int, object]] = {}
    for tensor in reader.tensors:
        target = _gguf_target(tensor.name)
        if target is not None:
            module, shard = target
            parts.setdefault(module, {})[shard] = tensor
    kept = []
    for module_name, shards in parts.items():
        blocks = _module_blocks(module_name, shards, architecture, hf_config)
        if blocks is None or not _packable(blocks):
            kept.append(module_name)
            continue
        if module_name == "embed_tokens":
            _serve_embedding(model, hf_config, blocks, dtype)
            continue
        linear = model.get_submodule(module_name)
        _check_shape(module_name, blocks, linear.out_features, linear.in_features)
        _replace(model, module_name, _packed_linear(blocks, linear.bias, dtype))
    if kept:
        logger.info("--quantization gguf: %d layers kept as loaded in %s", len(kept), dtype)
    release_freed_memory()
    return model


def _gguf_target(name: str) -> tuple[str, int] | None:
    if name == "token_embd.weight":
        return "embed_tokens", 0
    if name == "output.weight":
        return "lm_head", 0
    prefix, _, rest = name.partition(".")
    layer, _, rest = rest.partition(".")
    tensor, _, suffix = rest.partition(".")
    if prefix != "blk" or suffix != "weight" or tensor not in _GGUF_LAYER_TENSORS:
        return None
    module, shard = _GGUF_LAYER_TENSORS[tensor]
    return f"layers.{int(layer)}.{module}", shard


def _module_blocks(module_name, shards, architecture: str, hf_config) -> _Blocks | None:
    """The module's blocks, its shards' rows one after another; None if they cannot be served."""
    types = {tensor.tensor_type.name for tensor in shards.values()}
    if not types <= set(_BLOCK_TYPES) or ("Q8_0" in types and len(types) > 1):
        return None
    decoded = []
    for shard in sorted(shards):
        tensor = shards[shard]
        blocks = read_blocks(tensor)
        if architecture == "llama" and module_name.endswith("qkv_proj") and shard < 2:
            heads = hf_config.num_attention_heads if shard == 0 else hf_config.num_key_value_heads
            blocks = blocks.permuted(_reverse_permute_order(blocks.codes.shape[0], heads))
        decoded.append(blocks)
    if len(decoded) == 1:
        return decoded[0]
    zeros = None if "Q8_0" in types else np.concatenate([b.zeros for b in decoded])
    return _Blocks(
        decoded[0].type_name,
        np.concatenate([b.codes for b in decoded]),
        np.concatenate([b.scales for b in decoded]),
        zeros,
    )


def _packable(blocks: _Blocks) -> bool:
    rows, columns = blocks.codes.shape
    return Int4Linear.supports(rows if blocks.zeros is not None else 2 * rows, columns)


def _packed_linear(blocks: _Blocks, bias, dtype) -> QuantizedLinear:
    codes, scales = torch.from_numpy(blocks.codes), torch.from_numpy(blocks.scales)
    if blocks.zeros is None:
        if blocked_kernel_available(dtype):
            return Q8Linear.from_blocks(codes, scales, bias, dtype)
        return Q8BlockLinear.from_blocks(codes, scales, bias, dtype)
    return Int4Linear.from_codes(codes, scales, torch.from_numpy(blocks.zeros), bias, dtype)


def _serve_embedding(model: nn.Module, hf_config, blocks: _Blocks, dtype) -> None:
    embedding = model.embed_tokens
    _check_shape("embed_tokens", blocks, embedding.num_embeddings, embedding.embedding_dim)
    packed = _packed_linear(blocks, None, dtype)
    model.embed_tokens = RowsEmbedding(packed)
    if getattr(hf_config, "tie_word_embeddings", False):
        model.lm_head = packed


def _check_shape(name: str, blocks: _Blocks, rows: int, columns: int) -> None:
    if blocks.codes.shape != (rows, columns):
        raise ValueError(
            f"--quantization gguf: the GGUF tensor for {name} is {blocks.codes.shape}, the model "
            f"expects ({rows}, {columns})"
        )
