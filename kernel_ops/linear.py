"""Linear layers on the CPU with weights packed once at load: our blocked bfloat16 layout
(``BlockedLinear``, ``csrc/bf16_linear.cpp``: AVX512-BF16 dot products, AMX tiles, or on a CPU
without AVX512-BF16 AVX2 fused multiply-adds, over the same weights; its rows serve a tied
embedding, so that weight is held once), or oneDNN's packed layout (``PackedLinear``). Which one a
layer takes, and which kernel each call runs, is measured on the machine
(``kernel_ops/linear_tuning.py``); without a measurement, the blocked layout where it fits (the dot
products where the CPU has them, else the fused multiply-adds), else oneDNN's.

``torch.nn.functional.linear`` reads a plain row-major weight on every call, which oneDNN then
reorders on the fly; packing the weight once, with ``torch.ops.mkldnn._reorder_linear_weight``,
and computing with ``torch.ops.mkldnn._linear_pointwise`` gives the same products (bfloat16: bit
for bit; float32: to rounding) without that cost.
"""

from __future__ import annotations

import torch
from torch import nn

from llmrpc.kernels import cpu_ops
from llmrpc.kernels.layer import BF16, PACKED, LinearSpec

# The batch size oneDNN tunes the packed layout for: decode steps (1-32 rows) took the same time
# with 16 and 1024, and prefill steps of 1024 rows up to 1.16x less with 1024.
_PACKING_BATCH_HINT = 1024
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packs float32 weights on any x86 CPU and bfloat16 where the CPU computes it."""
    if (
        device.type != "cpu"
        or dtype not in PACKABLE_DTYPES
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's packed layout (not a plain tensor: read
    ``in_features``/``out_features``, not the weight's shape)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"PackedLinear: input has {x.shape[-1]} features, the layer takes "
                f"{self.in_features}"
            )
        if x.dim() != 2 or not x.is_contiguous():  # oneDNN's linear takes [rows, features]
            rows = x.reshape(-1, self.in_features).contiguous()
            out = _packed_matmul(rows, self.packed_weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return _packed_matmul(x, self.packed_weight, self.bias)

    def layer_spec(self) -> LinearSpec:
        """This layer as ``decode_layer`` calls it (``kernel_ops/layer.py``)."""
        return LinearSpec(PACKED, self.packed_weight, self.packed_weight.dtype, bias=self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def _packed_matmul(x: torch.Tensor, packed_weight: torch.Tensor, bias) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # the same call behind our own operation, which torch.compile can take (csrc/linear.cpp)
        return torch.ops.llmrpc_cpu.packed_linear.default(x, packed_weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


class BlockedLinear(nn.Module):
    """``y = x W^T + b`` in bfloat16 by ``torch.ops.llmrpc_cpu.bf16_linear``, ``W`` held as
    ``[out / 16, in / 2, 16, 2]`` (``csrc/bf16_linear.cpp`` describes it)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.weight_blocks = (
            weight.view(self.out_features // 16, 16, self.in_features // 2, 2)
            .permute(0, 2, 1, 3)
            .contiguous()
        )
        self.bias = None if linear.bias is None else linear.bias.detach()
        # the kernel for each bucket of rows per call (linear_tuning.ROW_BUCKETS): 0 dot products,
        # 1 AMX tiles, 2 the one-row kernel, 3 AVX2 fused multiply-adds, 4 their one-row form;
        # empty: the dot products for every call where the build has them, else the fused
        # multiply-adds
        self.kernel_by_bucket: list[int] = []

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        """Whether the kernels take this layer: bfloat16 on the CPU, outputs a multiple of 16,
        inputs of 2, and the kernels built with AVX512-BF16 or AVX2 and FMA."""
        weight = linear.weight
        return (
            weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and linear.out_features % 16 == 0
            and linear.in_features % 2 == 0
            and cpu_ops.load()
            and (
                torch.ops.llmrpc_cpu.bf16_linear_supported()
                or torch.ops.llmrpc_cpu.bf16_fma_supported()
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"BlockedLinear: input has {x.shape[-1]} features, the layer takes "
                f"{self.in_features}"
            )
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.llmrpc_cpu.bf16_linear.default(
            rows, self.weight_blocks, self.bias, self.kernel_by_bucket
        )
        return out.view(*x.shape[:-1], self.out_features)

    def layer_spec(self) -> LinearSpec:
        """This layer as ``decode_layer`` calls it (``kernel_ops/layer.py``)."""
        return LinearSpec(
            BF16, self.weight_blocks, self.weight_blocks.dtype, bias=self.bias,
            kernels=tuple(self.kernel_by_bucket),
        )  # fmt: skip

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``W`` ([len(ids), in_features]), read from the blocks."""
        return self.weight_blocks[ids // 16, :, ids % 16, :].reshape(ids.shape[0], -1)

    def extra_repr(self) -> str:
        kernels = f", kernels by rows {self.kernel_by_bucket}" if self.kernel_by_bucket else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, blocked{kernels}"


class RowsEmbedding(nn.Module):
    """An embedding whose rows are those of a linear layer's held weight (one tied to
    ``lm_head``), read with its ``rows(ids)``."""

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        self.source = source
        self.num_embeddings, self.embedding_dim = source.out_features, source.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.source.rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)


def shape_key(linear: nn.Linear) -> str:
    """``bfloat16 576x1536`` (inputs x outputs), `` bias`` where it has one: what a kernel's
    measurement is kept under."""
    dtype = str(linear.weight.dtype).removeprefix("torch.")
    bias = " bias" if linear.bias is not None else ""
    return f"{dtype} {linear.in_features}x{linear.out_features}{bias}"


# A layout and its kernel ids by bucket of rows (BlockedLinear.kernel_by_bucket).
Layout = tuple[str, list[int]]


def packable(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` that one of the layouts takes."""
    if type(module) is not nn.Linear:
        return False
    return BlockedLinear.fits(module) or can_pack(module.weight.dtype, module.weight.device)


def pack_linear_layers(model: nn.Module, layouts: dict[str, Layout] | None = None) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` that a layout takes (``packable``) by the
    layout ``layouts`` gives its shape (``blocked`` where it fits, else ``onednn``); for a shape
    it lacks, ``BlockedLinear`` where it fits, else ``PackedLinear``. The unpacked weights
    are dropped. An embedding tied to a layer made ``BlockedLinear`` reads its rows from the
    blocks (the weight is held once); one tied to a ``PackedLinear`` keeps the plain weight
    beside the packed copy. Returns how many were packed."""
    embeddings = tied_embeddings(model)
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not packable(child):
                continue
            weight = child.weight
            blocked = BlockedLinear.fits(child)
            default = ("blocked" if blocked else "onednn", [])
            layout, kernels = (layouts or {}).get(shape_key(child), default)
            if blocked and (layout == "blocked" or not can_pack(weight.dtype, weight.device)):
                replacement = BlockedLinear(child)
                replacement.kernel_by_bucket = list(kernels)
                if id(weight) in embeddings:
                    holder, embedding_name = embeddings[id(weight)]
                    setattr(holder, embedding_name, RowsEmbedding(replacement))
            else:
                replacement = PackedLinear(child)
            setattr(parent, name, replacement)
            packed += 1
    return packed


def tied_embeddings(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """``id(weight)`` -> (parent, name) of each plain embedding, to find the layers tied to one."""
    return {
        id(child.weight): (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Embedding
    }
