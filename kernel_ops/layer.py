"""A Llama-family decoder layer of a decodes-only step in one C++ call
(``torch.ops.llmrpc_cpu.decode_layer``, ``csrc/decode_layer.cpp``): the norms, the four linear
layers, rotary, the KV store, attention and SiLU, each by the kernel the layer's Python would
call, with the same bits, and none of the Python between them. Where every layer of a model
takes it, an eager step runs them all in one call (``decode_layers``, a ``LayerStack``).

A linear layer takes part where it describes itself (``layer_spec()``, a ``LinearSpec``): our
blocked bfloat16 layers, oneDNN's packed ones and the int4 and int8-code layers of
``--quantization``. Any other (a LoRA wrapper, torch's own packing) keeps the layer on its
Python path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmrpc.kernels.attention import AttentionMetadata, decode_kernel_planned, qkv_kernel_fits

# A linear layer's kind, as csrc/decode_layer.cpp reads it.
INT4, Q8, BF16, PACKED = 0, 1, 2, 3
_BUCKETS = 6  # bf16_linear's kernels by bucket of rows (linear_tuning.ROW_BUCKETS)


@dataclass(frozen=True)
class LinearSpec:
    """One linear layer as the C++ layer calls it: ``kind``'s operation on ``weight`` (and
    ``scales``), then ``bias``; ``dtype`` is the one its kernel computes in, and ``max_rows``
    the most rows it takes so (None: any)."""

    kind: int
    weight: torch.Tensor
    dtype: torch.dtype
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    tiles_from: int = 0  # int4 and q8: rows from which the AMX tile path runs (0: never)
    zeros: bool = False  # q8: scales hold (d, zero) pairs
    kernels: tuple[int, ...] = ()  # bf16: the kernel by bucket of rows (empty: its default)
    max_rows: int | None = None


@dataclass(frozen=True)
class LayerSpec:
    """The four linear layers of a decoder layer (qkv, o, gate_up, down) as the call takes
    them."""

    linears: list
    meta: list[int]
    dtype: torch.dtype
    max_rows: int | None


def layer_spec(qkv, o, gate_up, down) -> LayerSpec | None:
    """The four modules described for the call, or None where one does not describe itself,
    their kernels compute in different dtypes, or a kernel list is not one per bucket."""
    specs = []
    for module in (qkv, o, gate_up, down):
        describe = getattr(module, "layer_spec", None)
        spec = describe() if describe is not None else None
        if spec is None:
            return None
        specs.append(spec)
    if len({spec.dtype for spec in specs}) != 1:
        return None
    if any(len(spec.kernels) not in (0, _BUCKETS) for spec in specs):
        return None  # the call reads 6 kernels a layer, or none
    linears, meta = [], []
    for spec in specs:
        linears += [spec.weight, spec.scales, spec.bias]
        kernels = list(spec.kernels) if spec.kernels else [-1] * _BUCKETS
        meta += [spec.kind, spec.tiles_from, int(spec.zeros), *kernels]
    limits = [spec.max_rows for spec in specs if spec.max_rows is not None]
    return LayerSpec(linears, meta, specs[0].dtype, min(limits, default=None))


@dataclass(frozen=True)
class LayerStack:
    """Every layer of a model as one ``decode_layers`` call takes them: each layer's input and
    post-attention norm weights, and its four linear layers, in order."""

    norms: list
    linears: list
    meta: list[int]
    eps: float
    num_heads: int
    scale: float
    dtype: torch.dtype
    max_rows: int | None
    windowed: bool  # a layer attends within a window


def layer_stack(specs, norms, eps, num_heads, scale, windowed) -> LayerStack | None:
    """The layers' ``LayerSpec``s and norm weights (two a layer) as one stack, or None where a
    layer has none or their kernels compute in different dtypes."""
    if not specs or any(spec is None for spec in specs):
        return None
    if len({spec.dtype for spec in specs}) != 1:
        return None
    limits = [spec.max_rows for spec in specs if spec.max_rows is not None]
    return LayerStack(
        list(norms), [t for spec in specs for t in spec.linears],
        [m for spec in specs for m in spec.meta], eps, num_heads, scale, specs[0].dtype,
        min(limits, default=None), windowed,
    )  # fmt: skip


def fits(
    spec: LayerSpec | LayerStack,
    hidden,
    rotary,
    kv_cache,
    metadata: AttentionMetadata,
    num_heads: int,
) -> bool:
    """Whether the call takes this step, a decodes-only step on the torch backend (the caller
    knows it is): rows the linear kernels take in their dtype, and attention the decode kernel
    takes and the measured plan gives it for so many rows (``attention_tuning``)."""
    if metadata.padded or hidden.dtype != spec.dtype:
        return False
    # a compiled graph runs steps of at most max_rows rows only (engine/runner/compilation.py)
    compiling = torch.compiler.is_compiling()
    if spec.max_rows is not None and not compiling and hidden.shape[0] > spec.max_rows:
        return False
    if not qkv_kernel_fits(hidden, rotary, *kv_cache):
        return False
    return decode_kernel_planned(num_heads, kv_cache[0], hidden.shape[0])


def decode_layer(
    spec: LayerSpec,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norms: tuple[torch.Tensor, torch.Tensor],  # the input and post-attention norms' weights
    eps: float,
    rotary: tuple[torch.Tensor, torch.Tensor],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    num_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mlp output, residual stream before it)``, as ``LlamaDecoderLayer.forward`` returns
    them; ``residual`` None starts the stream (the first layer)."""
    first = residual is None
    if first:
        residual = torch.empty_like(hidden)
    cos, sin = rotary
    out = torch.ops.llmrpc_cpu.decode_layer.default(
        hidden.contiguous(), residual, first, norms[0], norms[1], eps, spec.linears, spec.meta,
        cos, sin, kv_cache[0], kv_cache[1], metadata.slot_mapping, metadata.decode_block_tables,
        metadata.decode_seq_lens, num_heads, scale,
    )  # fmt: skip
    return out, residual


def decode_layers(
    stack: LayerStack,
    hidden: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    kv_caches,  # each layer's (keys, values)
    metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the last layer's mlp output, residual stream before it)``, as the model's loop over
    ``LlamaDecoderLayer.forward`` ends with them."""
    cos, sin = rotary
    return torch.ops.llmrpc_cpu.decode_layers.default(
        hidden.contiguous(), stack.norms, stack.eps, stack.linears, stack.meta, cos, sin,
        [keys for keys, _ in kv_caches], [values for _, values in kv_caches],
        metadata.slot_mapping, metadata.decode_block_tables, metadata.decode_seq_lens,
        stack.num_heads, stack.scale,
    )  # fmt: skip
