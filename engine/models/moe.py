"""Mixture-of-Experts causal LMs on the paged KV cache: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Each is its dense sibling's attention (Llama's; Qwen2's q/k/v biases; Qwen3's per-head q/k norms;
OLMoE's norms over the whole q and k projections, and its ``clip_qkv``) with the MLP of some or all
layers a sparse block: a router (``gate``, computed in float32, never packed or quantized, since a
rounded router sends tokens to other experts), softmax over the experts in float32, the top k,
renormalised where the config says (Mixtral always; the others by ``norm_topk_prob``), and the
experts computed by ``llmrpc.kernels.moe.fused_experts`` (tokens grouped by expert, one matmul per
projection per expert hit). Qwen2-MoE adds a shared expert, gated by ``sigmoid(x w)``.

Experts are held fused: ``w13 [E, 2I, H]`` (each expert's gate rows, then its up rows) and
``w2 [E, H, I]``, as Transformers 5 holds them (``experts.gate_up_proj``, ``experts.down_proj``).
Checkpoints come either that way or per expert (Mixtral's ``block_sparse_moe.experts.N.w1|w3|w2``,
the others' ``mlp.experts.N.gate_proj|up_proj|down_proj``); both load.

Under tensor parallelism (``engine/parallel/layers.shard_moe``) every rank routes every token and
returns its part of the sum, which one all-reduce per block adds up: with
``--enable-expert-parallel`` a rank holds ``E / N`` whole experts (ids of the others become -1,
which the kernel skips); without it, every expert's intermediate features are split as a dense
MLP's are.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from llmrpc.engine.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP
from llmrpc.kernels.elementwise import silu_and_mul
from llmrpc.kernels.moe import experts_by_layer, fused_experts, register_expert_layers, route


class Router(nn.Linear):
    """The router's logits ``[T, E]``, in float32: its weight stays float32 whatever the model's
    dtype (a bfloat16 checkpoint's weight exactly), the hidden states are widened, and the sums
    are never rounded to 16 bits, so the top k are those of the exact logits. Quantization and CPU
    packing leave it as it is (they take plain ``nn.Linear`` only)."""

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.weight.data = self.weight.data.float()  # .to(dtype) moves it, never narrows it
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class FusedExperts(nn.Module):
    """The experts' weights, fused; this rank holds experts ``[first, first + num_experts)`` of
    ``total_experts`` (all of them but under expert parallelism).

    On the CPU's torch path (``unstack_experts``) each expert's projections become linear layers
    of their own (``gate_up[e]``, ``down[e]``), so that the CPU's packing (the kernel measured
    fastest for their shape, ``kernel_ops/linear_tuning.py``) and ``--quantization`` take them as
    they take every other linear layer."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = self.total_experts = num_experts
        self.first_expert = 0
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        nn.init.normal_(self.w13, std=0.02)
        nn.init.normal_(self.w2, std=0.02)
        self.gate_up: nn.ModuleList | None = None  # set by unstack
        self.down: nn.ModuleList | None = None
        self.layer_name = ""

    def unstack(self) -> None:
        """Each expert's projections as linear layers over views of the fused weights, which
        are dropped (so their memory goes once every view is packed or quantized)."""
        w13, w2 = self.w13.detach(), self.w2.detach()
        del self.w13, self.w2
        self.gate_up = nn.ModuleList(_linear(w13[e]) for e in range(self.num_experts))
        self.down = nn.ModuleList(_linear(w2[e]) for e in range(self.num_experts))
        self.layer_name = register_expert_layers(self)

    def expert(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` (unstacked) on ``rows [n, H]``."""
        return self.down[index](silu_and_mul(self.gate_up[index](rows)))

    def forward(self, x, topk_weights, topk_ids, backend: str) -> torch.Tensor:
        if self.num_experts != self.total_experts:  # ids of experts held elsewhere: -1
            local = topk_ids - self.first_expert
            held = (local >= 0) & (local < self.num_experts)
            topk_ids = torch.where(held, local, torch.full_like(local, -1))
        if self.gate_up is not None:
            return experts_by_layer(x, topk_weights, topk_ids, self.layer_name)
        return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids, backend)


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def unstack_experts(model: nn.Module) -> int:
    """Unstack every ``FusedExperts`` of ``model`` (see its docstring); how many."""
    experts = [m for m in model.modules() if isinstance(m, FusedExperts) and m.gate_up is None]
    for module in experts:
        module.unstack()
    return len(experts)


class SparseMoeBlock(nn.Module):
    """Router, top-k experts and (Qwen2-MoE) a gated shared expert. ``comm`` is set by tensor
    parallelism: the block then returns this rank's part, all-reduced once."""

    def __init__(
        self,
        config,
        num_experts: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = renormalize
        self.gate = Router(config.hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, config.hidden_size, intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, shared_intermediate_size)
            self.shared_expert_gate = Router(config.hidden_size, 1, bias=False)
        self.comm = None

    def forward(self, x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        topk_weights, topk_ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids, backend)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x)).to(x.dtype)
            out = out + gate * self.shared_expert(x)
        if self.comm is not None:
            self.comm.all_reduce(out)
        return out


# a checkpoint's per-expert weight: (layer, expert, projection)
_PER_EXPERT = re.compile(
    r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
)
# projection -> (our parameter, shard: 0 gate rows, 1 up rows, None whole)
_EXPERT_SHARDS = {
    "w1": ("w13", 0),
    "gate_proj": ("w13", 0),
    "w3": ("w13", 1),
    "up_proj": ("w13", 1),
    "w2": ("w2", None),
    "down_proj": ("w2", None),
}
_FUSED_EXPERTS = {"gate_up_proj": "w13", "down_proj": "w2"}


class MoeForCausalLM(LlamaForCausalLM):
    """What the MoE families share: which layers are sparse, and the experts' loading."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._expert_parts: dict[str, set] = {}  # parameter -> the parts loaded so far

    # per family
    def num_experts(self, config) -> int:
        return config.num_experts

    def expert_intermediate_size(self, config) -> int:
        return config.moe_intermediate_size

    def renormalize(self, config) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))

    def shared_intermediate_size(self, config) -> int:
        return 0

    def is_sparse(self, config, index: int) -> bool:
        """Qwen's rule: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""
        step = getattr(config, "decoder_sparse_step", None) or 1
        only_mlp = getattr(config, "mlp_only_layers", None) or []
        return index not in only_mlp and (index + 1) % step == 0

    def build_mlp(self, config, index: int) -> nn.Module:
        if not self.is_sparse(config, index):
            return LlamaMLP(config)
        return SparseMoeBlock(
            config,
            self.num_experts(config),
            self.expert_intermediate_size(config),
            self.renormalize(config),
            self.shared_intermediate_size(config),
        )

    def load_other_weight(self, name: str, tensor: torch.Tensor) -> bool:
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
        if ".mlp.gate." in name:
            param = self.get_parameter(name)
            with torch.no_grad():
                param.copy_(tensor)
            self._expert_parts.setdefault(name, set()).add("whole")
            return True
        match = _PER_EXPERT.fullmatch(name)
        if match is not None:
            layer, expert, projection = match.groups()
            target, shard = _EXPERT_SHARDS[projection]
            param_name = f"layers.{layer}.mlp.experts.{target}"
            param = self.get_parameter(param_name)[int(expert)]
            if shard is not None:
                size = param.shape[0] // 2
                param = param[shard * size : (shard + 1) * size]
            self._copy_part(param_name, param, tensor, (int(expert), shard))
            return True
        for fused, target in _FUSED_EXPERTS.items():
            if name.endswith(f".mlp.experts.{fused}"):
                param_name = name.removesuffix(fused) + target
                self._copy_part(param_name, self.get_parameter(param_name), tensor, "whole")
                return True
        return False

    def _copy_part(self, name: str, param: torch.Tensor, tensor: torch.Tensor, part) -> None:
        if param.shape != tensor.shape:
            raise ValueError(
                f"checkpoint weight for {name} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        self._expert_parts.setdefault(name, set()).add(part)

    def loaded_other_weights(self) -> set[str]:
        """The routers and expert weights loaded whole: fused, or every expert's every part."""
        done = set()
        for name, parts in self._expert_parts.items():
            if "whole" in parts:
                done.add(name)
                continue
            experts = self.get_submodule(name.rsplit(".", 1)[0]).num_experts
            shards = (0, 1) if name.endswith("w13") else (None,)
            if parts >= {(e, s) for e in range(experts) for s in shards}:
                done.add(name)
        return done


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: every layer sparse, top-k weights always renormalised."""

    def num_experts(self, config) -> int:
        return config.num_local_experts

    def expert_intermediate_size(self, config) -> int:
        return config.intermediate_size

    def renormalize(self, config) -> bool:
        return True

    def is_sparse(self, config, index: int) -> bool:
        return True


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention; a shared expert beside the routed ones."""

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)

    def shared_intermediate_size(self, config) -> int:
        return getattr(config, "shared_expert_intermediate_size", 0) or 0


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, routed experts only."""

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE: q and k normed over their whole projections, ``clip_qkv``; every layer sparse."""

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        clip = getattr(config, "clip_qkv", None)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm_whole=True, clip_qkv=clip)

    def expert_intermediate_size(self, config) -> int:
        return config.intermediate_size

    def is_sparse(self, config, index: int) -> bool:
        return True
