"""``--quantization gguf``: a .gguf model's quantized tensors served from their own blocks (see
``quantize_model_from_gguf``), packed as ``layers``' int4 and int8-code layers; its other tensors
stay as dequantized at load.

Every block type served is first read as ``W = code * scale + zero``: integer codes, a scale per
32 inputs (per 16 for Q6_K) and a zero per 32 (none for the symmetric types), all exact in float32
from the file's float16 and 6-bit fields. The 4-bit types (Q4_0, Q4_1, Q4_K) are then packed as
int4; the 5-, 6- and 8-bit ones (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) as int8 codes, one byte a weight.
"""

from __future__ import annotations

import logging
from collections import Counter
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
    # Qwen2-MoE's shared expert
    "ffn_gate_shexp": ("mlp.shared_expert.gate_up_proj", 0),
    "ffn_up_shexp": ("mlp.shared_expert.gate_up_proj", 1),
    "ffn_down_shexp": ("mlp.shared_expert.down_proj", 0),
}
# A MoE layer's experts, one tensor [E, out, in] each -> (each expert's module under
# layers.N.mlp.experts, as engine/models/moe.FusedExperts.unstack makes them; shard)
_GGUF_EXPERT_TENSORS = {
    "ffn_gate_exps": ("gate_up", 0),
    "ffn_up_exps": ("gate_up", 1),
    "ffn_down_exps": ("down", 0),
}
# The GGML types served from their blocks, and the bytes of one block (32 weights; 256 for _K)
BLOCK_BYTES = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q8_0": 34,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
}
_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})


@dataclass
class _Blocks:
    """A tensor's (or a fused module's) weights over ``[rows, in]`` (rows: the outputs) as
    ``W = codes * scale + zero``."""

    types: tuple[str, ...]  # the GGML types of its parts
    codes: np.ndarray  # int8 [rows, in]; in [-8, 7] for the 4-bit types
    scales: np.ndarray  # float32 [rows, in / 32], or [rows, in / 16] (Q6_K)
    zeros: np.ndarray | None  # float32 [rows, in / 32]; None where every zero is 0

    @property
    def group(self) -> int:
        """Inputs per scale: 32, or 16."""
        return self.codes.shape[1] // self.scales.shape[1]

    def permuted(self, order: np.ndarray) -> _Blocks:
        zeros = None if self.zeros is None else self.zeros[order]
        return _Blocks(self.types, self.codes[order], self.scales[order], zeros)


def _f16(raw: np.ndarray) -> np.ndarray:
    """float32 of the little-endian float16 in the last axis's 2 bytes."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles, then the high ones."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of a little-endian uint32 (4 bytes) as element j's fifth bit, shifted in place."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant block's 12 bytes -> its 8 sub-blocks' 6-bit scales and mins: sub-blocks 0-3 in
    the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 with
    the top 2 bits of bytes 0-3 (scales) and 4-7 (mins) above them."""
    low_scales, low_mins, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low_scales & 63, (rest & 15) | ((low_scales >> 6) << 4)], axis=-1)
    mins = np.concatenate([low_mins & 63, (rest >> 4) | ((low_mins >> 6) << 4)], axis=-1)
    return scales, mins


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 codes: 4 runs of 32 bytes, each the low nibbles of one sub-block of 32
    and the high nibbles of the next."""
    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([runs & 15, runs >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _decode(name: str, b: np.ndarray):
    """(codes, scales, zeros or None) of blocks ``b`` ``[rows, blocks, bytes]`` of type ``name``:
    ``W = codes * scales + zeros``, codes per block, scales and zeros per 32 (Q6_K: 16) inputs.

    Q4_0: f16 d, 16 bytes of nibbles, W = d (u - 8).  Q4_1: d, f16 m, nibbles, W = d u + m.
    Q5_0 / Q5_1: as Q4_x with a 4-byte plane of fifth bits before the nibbles, u - 16.
    Q8_0: d, 32 int8 q, W = d q.
    Q4_K / Q5_K: f16 d and dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth
    bits, bit s of byte l for sub-block s), 128 bytes of nibbles; W = d sc u - dmin m per 32.
    Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, f16 d;
    W = d sc (u - 32) per 16.
    """
    rows, count = b.shape[:2]
    if name == "Q8_0":
        return b[..., 2:].copy().view(np.int8), _f16(b[..., 0:2]), None
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(b[..., 0:2])
        start = 2 if name.endswith("_0") else 4
        if name.startswith("Q4"):
            codes, middle = _nibbles(b[..., start:]).astype(np.int16), 8
        else:
            bits = _fifth_bits(b[..., start : start + 4])
            codes, middle = (_nibbles(b[..., start + 4 :]) | bits).astype(np.int16), 16
        zeros = _f16(b[..., 2:4]) + middle * d if name.endswith("_1") else None
        return codes - middle, d, zeros
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sub_scales, sub_mins = _k_scales_mins(b[..., 4:16])
        scales, mins = d * sub_scales, dmin * sub_mins  # [rows, blocks, 8]
        if name == "Q4_K":
            codes, middle = _k_low_nibbles(b[..., 16:144]).astype(np.int16), 8
        else:
            qh = b[..., 16:48]  # [rows, blocks, 32]
            bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            codes = _k_low_nibbles(b[..., 48:176]) | (bits << 4).reshape(rows, count, 256)
            codes, middle = codes.astype(np.int16), 16
        return codes - middle, scales, middle * scales - mins
    if name == "Q6_K":
        ql = b[..., 0:128].reshape(rows, count, 2, 2, 32)  # [.., half of 128, run of 32, l]
        qh = b[..., 128:192].reshape(rows, count, 2, 1, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # [.., half, 4 runs, 32]
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        codes = (low | (high << 4)).reshape(rows, count, 256).astype(np.int16) - 32
        sub_scales = b[..., 192:208].copy().view(np.int8).astype(np.float32)
        return codes, _f16(b[..., 208:210])[..., None] * sub_scales, None
    raise ValueError(f"GGML type {name} is not served from its blocks")


def read_blocks(tensor) -> _Blocks:
    """Decode a tensor of a ``gguf.GGUFReader`` whose type is in ``BLOCK_BYTES``."""
    name = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    rows = data.shape[0]
    codes, scales, zeros = _decode(name, data.reshape(rows, -1, BLOCK_BYTES[name]))
    return _Blocks(
        (name,),
        codes.reshape(rows, -1).astype(np.int8),
        scales.reshape(rows, -1).astype(np.float32),
        None if zeros is None else zeros.reshape(rows, -1).astype(np.float32),
    )


def _reverse_permute_order(rows: int, num_heads: int) -> np.ndarray:
    """The row order undoing llama.cpp's rotary permutation of q/k (as Transformers' GGUF
    loader undoes it for the llama architecture)."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(rows)


def quantize_model_from_gguf(
    model: nn.Module, gguf_path: Path, hf_config, dtype: torch.dtype
) -> nn.Module:
    """Swap the linear layers (and a tied or quantized embedding) of a native model for packed
    ones built from the GGUF file's own blocks.

    A fused layer (qkv_proj, gate_up_proj) is packed as int4 when all its parts are 4-bit types,
    else as int8 codes (a zero per 32 where any part has one, a scale per 16 where any is Q6_K;
    both at once has no kernel, and such a layer keeps the weights loaded). A tensor of another
    type (F16, Q2_K, Q3_K, the IQ types...) keeps the weights already loaded: the file
    dequantized. Call it before ``model.to(dtype)``.
    """
    import gguf  # only for a .gguf file

    if not hasattr(model, "layers") or not hasattr(model, "embed_tokens"):
        raise ValueError(
            "--quantization gguf serves the native decoder families (--help=models lists them); "
            "use --model-impl auto or vllm"
        )
    reader = gguf.GGUFReader(str(gguf_path))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    parts: dict[str, dict[int, object]] = {}
    for tensor in reader.tensors:
        for module, shard, part in _gguf_targets(tensor):
            parts.setdefault(module, {})[shard] = part
    served, kept = Counter(), Counter()
    for module_name, shards in parts.items():
        types = "+".join(sorted({t.tensor_type.name for t in shards.values()}))
        layer = model.get_submodule(module_name)
        blocks = _module_blocks(module_name, shards, architecture, hf_config)
        packed = (
            None if blocks is None else _packed_linear(blocks, getattr(layer, "bias", None), dtype)
        )
        if packed is None:
            kept[types] += 1
            continue
        served[types] += 1
        if module_name == "embed_tokens":
            _serve_embedding(model, hf_config, blocks, packed)
            continue
        _check_shape(module_name, blocks, layer.out_features, layer.in_features)
        _replace(model, module_name, packed)
    logger.info(
        "--quantization gguf: %d layers served from their blocks (%s); %d kept as loaded in %s%s",
        served.total(),
        _counts(served),
        kept.total(),
        dtype,
        f" ({_counts(kept)})" if kept else "",
    )
    release_freed_memory()
    return model


def _counts(counter: Counter) -> str:
    return ", ".join(f"{count} {types}" for types, count in sorted(counter.items()))


@dataclass(frozen=True)
class _Expert:
    """One expert's slice of a GGUF tensor of experts, read as a tensor of its own."""

    tensor_type: object
    data: np.ndarray


def _gguf_targets(tensor) -> list[tuple[str, int, object]]:
    """``(our module, shard, the tensor or its slice)`` for each module the tensor feeds."""
    name = tensor.name
    if name == "token_embd.weight":
        return [("embed_tokens", 0, tensor)]
    if name == "output.weight":
        return [("lm_head", 0, tensor)]
    prefix, _, rest = name.partition(".")
    layer, _, rest = rest.partition(".")
    kind, _, suffix = rest.partition(".")
    if prefix != "blk" or suffix != "weight":
        return []
    if kind in _GGUF_EXPERT_TENSORS:
        module, shard = _GGUF_EXPERT_TENSORS[kind]
        data = np.asarray(tensor.data)  # [E, out, in's blocks]
        return [
            (f"layers.{int(layer)}.mlp.experts.{module}.{e}", shard, _Expert(tensor.tensor_type, d))
            for e, d in enumerate(data)
        ]
    if kind not in _GGUF_LAYER_TENSORS:
        return []
    module, shard = _GGUF_LAYER_TENSORS[kind]
    return [(f"layers.{int(layer)}.{module}", shard, tensor)]


def _module_blocks(module_name, shards, architecture: str, hf_config) -> _Blocks | None:
    """The module's blocks, its shards' rows one after another; None if they cannot be served."""
    if any(tensor.tensor_type.name not in BLOCK_BYTES for tensor in shards.values()):
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
    group = min(blocks.group for blocks in decoded)
    with_zeros = any(blocks.zeros is not None for blocks in decoded)
    if group < 32 and with_zeros:
        return None
    zeros = [b.zeros if b.zeros is not None else np.zeros_like(b.scales) for b in decoded]
    return _Blocks(
        tuple(name for blocks in decoded for name in blocks.types),
        np.concatenate([blocks.codes for blocks in decoded]),
        np.concatenate([np.repeat(b.scales, b.group // group, axis=1) for b in decoded]),
        np.concatenate(zeros) if with_zeros else None,
    )


def _packed_linear(blocks: _Blocks, bias, dtype) -> QuantizedLinear | None:
    """The packed layer for ``blocks``, or None where no packing here takes them."""
    rows, columns = blocks.codes.shape
    if not Int4Linear.supports(rows, columns):  # every packing: out % 16, whole groups of 32
        return None
    codes, scales = torch.from_numpy(blocks.codes), torch.from_numpy(blocks.scales)
    zeros = None if blocks.zeros is None else torch.from_numpy(blocks.zeros)
    if set(blocks.types) <= _INT4_TYPES:
        zeros = torch.zeros_like(scales) if zeros is None else zeros
        return Int4Linear.from_codes(codes + 8, scales, zeros, bias, dtype)
    if blocked_kernel_available(dtype):
        return Q8Linear.from_blocks(codes, scales, bias, dtype, zeros=zeros)
    if blocks.group == 32:
        return Q8BlockLinear.from_blocks(codes, scales, bias, dtype, zeros=zeros)
    return None


def _serve_embedding(model: nn.Module, hf_config, blocks: _Blocks, packed) -> None:
    embedding = model.embed_tokens
    _check_shape("embed_tokens", blocks, embedding.num_embeddings, embedding.embedding_dim)
    model.embed_tokens = RowsEmbedding(packed)
    if getattr(hf_config, "tie_word_embeddings", False):
        model.lm_head = packed


def _check_shape(name: str, blocks: _Blocks, rows: int, columns: int) -> None:
    if blocks.codes.shape != (rows, columns):
        raise ValueError(
            f"--quantization gguf: the GGUF tensor for {name} is {blocks.codes.shape}, the model "
            f"expects ({rows}, {columns})"
        )
