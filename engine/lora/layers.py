"""LoRA on the native Llama-family models: each adapted projection is wrapped, whatever module
the loader left there (plain, packed, blocked or quantized), as ``out = base(x)`` plus the
adapters' ``(x @ A.T) @ B.T``, added in place by the segmented kernels of ``kernel_ops/lora.py``.

Each wrapper holds ``--max-loras`` slots of stacked weights. The fused projections serve several
checkpoint modules (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up): their slices' A are
stacked along the rank (``a [S, n*R, in]``) and B is block-diagonal (``b [S, out, n*R]``), so one
shrink and one expand serve the fused layer. The scaling is already in B (``engine/lora_peft``).

The model runner sets the step's ``LoRABatch`` on the shared ``LoRAContext`` before the forward;
when no row of the step uses an adapter it is None and the wrappers cost one attribute read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmrpc.engine.lora.peft import LoRAAdapter
from llmrpc.engine.models.llama import LlamaForCausalLM
from llmrpc.engine.models.moe import MoeForCausalLM
from llmrpc.engine.runner.device import model_device
from llmrpc.kernels.linear import pack_linear_layers
from llmrpc.kernels.lora import LoRABatch, lora_expand, lora_shrink

# On the CPU, a step of at most this many rows takes every slot's adapter in one masked matmul
# (``LoRAContext.dense``) instead of a gather, matmul and scatter per slot: at decode sizes the
# per-slot ops' fixed costs outweigh the other slots' wasted multiply-adds (docs/performance.md,
# LoRA). Longer steps (prompt chunks) take the segmented kernels' torch twin.
DENSE_MAX_ROWS = 128


class LoRAContext:
    """What every LoRA wrapper of a model reads during one forward pass."""

    def __init__(self, dense_allowed: bool = False) -> None:
        self.dense_allowed = dense_allowed  # the torch backend on the CPU
        self.batch: LoRABatch | None = None  # None: no row uses an adapter this step
        self.dense = False  # this step takes the dense path

    def set_batch(self, batch: LoRABatch | None, num_rows: int) -> None:
        self.batch = batch
        self.dense = batch is not None and self.dense_allowed and num_rows <= DENSE_MAX_ROWS
        self._onehot: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}
        self._num_rows = num_rows

    def onehot(self, num_slots: int, like: torch.Tensor) -> torch.Tensor:
        """``[num_rows, num_slots]``: 1 where a row uses a slot (none for base-model rows)."""
        if self._onehot is None:
            onehot = like.new_zeros(self._num_rows, num_slots)
            for slot, rows in self.batch.slot_rows:
                onehot[rows, slot] = 1
            self._onehot = onehot
        return self._onehot

    def mask(self, num_slots: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """``[num_rows, num_slots * width]``: each row's own slot's ``width`` columns."""
        mask = self._masks.get(width)
        if mask is None:
            onehot = self.onehot(num_slots, like)
            mask = self._masks[width] = onehot.repeat_interleave(width, dim=1)
        return mask


@dataclass(frozen=True)
class FusedTarget:
    """A projection of a decoder layer and the checkpoint modules it serves, in output order."""

    block: str  # "self_attn" or "mlp"
    attribute: str  # e.g. "qkv_proj"
    modules: tuple[str, ...]  # e.g. ("q_proj", "k_proj", "v_proj")


TARGETS = (
    FusedTarget("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    FusedTarget("self_attn", "o_proj", ("o_proj",)),
    FusedTarget("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    FusedTarget("mlp", "down_proj", ("down_proj",)),
)


def served_targets(model: LlamaForCausalLM) -> tuple[FusedTarget, ...]:
    """The projections LoRA adapts: all of ``TARGETS``; a MoE model's attention only (neither
    its experts nor, for one rule across its layers, its dense MLPs take adapters)."""
    if isinstance(model, MoeForCausalLM):
        return tuple(target for target in TARGETS if target.block == "self_attn")
    return TARGETS


def module_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of every checkpoint module LoRA may adapt."""
    attn, config = model.layers[0].self_attn, model.config
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "q_proj": (hidden, attn.q_size),
        "k_proj": (hidden, attn.kv_size),
        "v_proj": (hidden, attn.kv_size),
        "o_proj": (attn.q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    served = {name for target in served_targets(model) for name in target.modules}
    return {name: shape for name, shape in shapes.items() if name in served}


class LoRALinear(nn.Module):
    """``base(x)`` plus, for the rows of adapted requests, their slot's ``(x @ A.T) @ B.T``."""

    def __init__(
        self,
        base: nn.Module,
        shapes: list[tuple[int, int]],  # (in, out) of each slice, in output order
        num_slots: int,
        max_rank: int,
        with_bias: bool,
        context: LoRAContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.max_rank = max_rank
        in_features = shapes[0][0]
        self.out_sizes = [out for _, out in shapes]
        rank_total, out_total = max_rank * len(shapes), sum(self.out_sizes)
        # plain attributes, not buffers: the weights are the adapters', not the model's
        self.a_stacked = torch.zeros(num_slots, rank_total, in_features, dtype=dtype, device=device)
        self.b_stacked = torch.zeros(num_slots, out_total, rank_total, dtype=dtype, device=device)
        self.bias_stacked = (
            torch.zeros(num_slots, out_total, dtype=dtype, device=device) if with_bias else None
        )
        self._repack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.context.batch
        if batch is None:
            return out
        if self.context.dense:
            return self._dense(x, out)
        h = lora_shrink(x, self.a_stacked, batch)  # [num_tokens, n * max_rank]
        lora_expand(h, self.b_stacked, batch, out, self.bias_stacked)
        return out

    def _dense(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every slot's shrink for every row in one matmul, the other slots' columns zeroed,
        then one expand: the same sums as the segmented kernels for each row's own slot."""
        num_slots, width, _ = self.a_stacked.shape
        # [num_rows, num_slots * width]
        h = self.shrink_all(x).mul_(self.context.mask(num_slots, width, x))
        out.add_(self.expand_all(h))
        if self.bias_stacked is not None:
            out.addmm_(self.context.onehot(num_slots, x), self.bias_stacked)
        return out

    def _repack(self) -> None:
        """Every slot's A and B as two linear layers of the engine's CPU kernels (blocked or
        packed once, as the base layers are: a plain matmul would reorder them every call)."""
        if not self.context.dense_allowed:
            return
        num_slots, width, in_features = self.a_stacked.shape
        shrink = self.a_stacked.reshape(num_slots * width, in_features)  # [S * W, in]
        # [out, S * W]: column s * W + w is slot s's B column w, as shrink's rows are ordered
        expand = self.b_stacked.permute(1, 0, 2).reshape(-1, num_slots * width)
        self.shrink_all, self.expand_all = _cpu_linear(shrink), _cpu_linear(expand)

    def set_slot(self, slot: int, slices: list) -> None:
        """Put one adapter's weights in ``slot``: ``slices[i]`` is the ``LoRAWeights`` of the
        i-th slice, or None where the adapter leaves that slice alone."""
        self.a_stacked[slot].zero_()
        self.b_stacked[slot].zero_()
        if self.bias_stacked is not None:
            self.bias_stacked[slot].zero_()
        offset = 0
        for index, (weights, out_size) in enumerate(zip(slices, self.out_sizes, strict=True)):
            if weights is not None:
                rank, first = weights.a.shape[0], index * self.max_rank
                self.a_stacked[slot, first : first + rank].copy_(weights.a)
                self.b_stacked[slot, offset : offset + out_size, first : first + rank].copy_(
                    weights.b
                )
                if weights.bias is not None and self.bias_stacked is not None:
                    self.bias_stacked[slot, offset : offset + out_size].copy_(weights.bias)
            offset += out_size
        self._repack()


def _cpu_linear(weight: torch.Tensor) -> nn.Module:
    """``x @ weight.T`` (``weight [out, in]``) as the engine's CPU linear layers compute it."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    holder = nn.Sequential(linear)
    pack_linear_layers(holder)  # where the dtype and CPU allow, else the plain layer
    return holder[0]


class LoRAModel:
    """The LoRA wrappers of one model, addressed by (layer index, projection)."""

    def __init__(
        self,
        model: nn.Module,
        num_slots: int,
        max_rank: int,
        with_bias: bool,
        dtype: torch.dtype,
        dense: bool = True,  # on the CPU, small steps may take the dense path
    ) -> None:
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(
                f"--enable-lora serves the native Llama-family models; {type(model).__name__} "
                "(e.g. --model-impl transformers) has no LoRA support here"
            )
        device = model_device(model)
        self.context = LoRAContext(dense_allowed=dense and device.type == "cpu")
        self.shapes = module_shapes(model)
        self.targets = served_targets(model)
        self.num_layers = len(model.layers)
        self.wrappers: dict[tuple[int, str], LoRALinear] = {}
        for index, layer in enumerate(model.layers):
            for target in self.targets:
                block = getattr(layer, target.block)
                shapes = [self.shapes[name] for name in target.modules]
                wrapper = LoRALinear(
                    getattr(block, target.attribute),
                    shapes,
                    num_slots,
                    max_rank,
                    with_bias,
                    self.context,
                    dtype,
                    device,
                )
                setattr(block, target.attribute, wrapper)
                self.wrappers[index, target.attribute] = wrapper

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Load ``adapter`` into ``slot`` of every wrapper (None: clear it)."""
        modules = adapter.modules if adapter is not None else {}
        for (index, attribute), wrapper in self.wrappers.items():
            target = next(t for t in self.targets if t.attribute == attribute)
            wrapper.set_slot(slot, [modules.get((index, name)) for name in target.modules])
