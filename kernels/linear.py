"""Linear layers on the CPU with weights packed once at load (oneDNN's blocked layout).

``torch.nn.functional.linear`` reads a plain row-major weight on every call; oneDNN then reorders
it on the fly, and at small batches (decode) that doubles the time of a step's matmuls. Packing
the weight once, with ``torch.ops.mkldnn._reorder_linear_weight``, and computing with
``torch.ops.mkldnn._linear_pointwise`` gives the same products (bfloat16: bit for bit; float32:
to rounding) in half the time at batch 1 (bfloat16 and float32 alike) and faster or level up to
long prefills (measured with 1 thread on 8 SmolLM2-sized layers: bfloat16 batch 1 1.7 vs 3.6 ms,
batch 32 5.2 vs 7.0 ms, batch 2048 level; float32 batch 1 3.1 vs 6.5 ms, batch 256 62 vs 139 ms).
"""

from __future__ import annotations

import torch
from torch import nn

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

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def _packed_matmul(x: torch.Tensor, packed_weight: torch.Tensor, bias) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # the same call behind our own operation, which torch.compile can take (csrc/linear.cpp)
        return torch.ops.llmrpc_cpu.packed_linear(x, packed_weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` whose weight can be packed by a
    ``PackedLinear``; the unpacked weights are dropped (a weight tied to an embedding stays
    with the embedding). Returns how many were packed."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "weight", None)
            if type(child) is nn.Linear and can_pack(weight.dtype, weight.device):
                setattr(parent, name, PackedLinear(child))
                packed += 1
    return packed
