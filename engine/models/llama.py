"""Native Llama-family causal LMs (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) on the paged
KV cache.

Works on the flat batch: ``input_ids`` and ``positions`` are ``[num_tokens]``, every request's
new tokens one after another; attention finds each request's context through the cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from llmrpc.engine.models.rotary import RotaryEmbedding, rope_parameters
from llmrpc.kernels import layer as fused_layer
from llmrpc.kernels.attention import (
    AttentionMetadata,
    decode_attention_qkv,
    paged_attention,
    write_kv,
)
from llmrpc.kernels.elementwise import add_rms_norm, rms_norm, silu_and_mul
from llmrpc.kernels.elementwise import rotary as apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, backend="torch"):
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, backend)
        return add_rms_norm(x, residual, self.weight, self.eps, backend)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config) -> int | None:
    """The attention window of a model that uses one (Mistral v0.1, Phi-3; Qwen2 when enabled)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def layer_windows(config) -> list[int | None]:
    """Each layer's attention window (None: full attention): as ``layer_types`` says where the
    config has them, else the model's window in every layer."""
    window = sliding_window_of(config)
    types = getattr(config, "layer_types", None)
    if not types:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


def rotary_dim_of(config) -> int:
    """The dimensions of a head that rotary turns: all, or ``partial_rotary_factor`` of them."""
    factor = getattr(config, "partial_rotary_factor", None)
    factor = factor or rope_parameters(config).get("partial_rotary_factor") or 1.0
    return int(head_dim_of(config) * factor)


@dataclass(frozen=True)
class AttentionOptions:
    """Where the Llama-family members differ in their attention block."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    # RMSNorm over the whole q and k projections before rotary (OLMoE)
    qk_norm_whole: bool = False
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] (OLMoE's clip_qkv)


class LlamaAttention(nn.Module):
    def __init__(self, config, options: AttentionOptions, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # a row sees the last ``window`` positions (None: all)
        self.softcap: float | None = None  # scores capped to softcap * tanh(s / softcap)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=options.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=options.o_bias)
        if options.qk_norm or options.qk_norm_whole:
            per_head = options.qk_norm
            self.q_norm = RMSNorm(self.head_dim if per_head else self.q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else self.kv_size, config.rms_norm_eps)
        self.qk_norm = options.qk_norm
        self.qk_norm_whole = options.qk_norm_whole
        self.clip_qkv = options.clip_qkv
        self.rotary_dim = rotary_dim_of(config)
        self.scale = self.head_dim**-0.5
        # an fp8 KV cache's scales (--kv-cache-dtype): 1, as where a checkpoint carries none
        self.kv_scales = (1.0, 1.0)

    def forward(self, rotary, hidden, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        backend = metadata.backend
        qkv = self.qkv_proj(hidden)
        if self._fused_decode(metadata):
            out = decode_attention_qkv(qkv, rotary, *kv_cache, metadata, self.num_heads, self.scale)
            if out is not None:
                return self.o_proj(out.view(num_tokens, self.q_size))
        if self.qk_norm_whole:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q = self.q_norm(q.contiguous(), None, backend)
            k = self.k_norm(k.contiguous(), None, backend)
            qkv = torch.cat((q, k, qkv[:, self.q_size + self.kv_size :]), dim=1)
        if self.clip_qkv is not None:  # after the norms, as OLMoE clips
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim), None, backend)
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim), None, backend)
            q, k = self._rotate(q, rotary, backend), self._rotate(k, rotary, backend)
        else:  # rotary is per head: the query and key heads take it in one pass
            heads = self.num_heads + self.num_kv_heads
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, self.head_dim)
            qk = self._rotate(qk, rotary, backend)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        key_cache, value_cache = kv_cache
        write_kv(k, v, key_cache, value_cache, metadata, self.kv_scales)
        out = paged_attention(
            q, key_cache, value_cache, metadata, self.scale, self.kv_scales, self.window,
            self.softcap,
        )  # fmt: skip
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _fused_decode(self, metadata: AttentionMetadata) -> bool:
        """Whether this layer's q, k and v go as they come out of ``qkv_proj`` to rotary over
        whole heads, the KV store and attention, with no window the step reaches past and no
        softcap: where ``decode_attention_qkv`` may compute the three in one call."""
        return self.fuses_qkv() and (self.window is None or not metadata.past_window)

    def fuses_qkv(self) -> bool:
        """``_fused_decode`` but for the window, which each step decides."""
        return (
            not (self.qk_norm or self.qk_norm_whole)
            and self.clip_qkv is None
            and self.rotary_dim == self.head_dim
            and self.softcap is None
        )

    def _rotate(self, heads: torch.Tensor, rotary, backend: str) -> torch.Tensor:
        """Rotary over each head's first ``rotary_dim`` dimensions (all of them but where a
        config's ``partial_rotary_factor`` keeps the rest as they are)."""
        cos, sin = rotary
        if self.rotary_dim == self.head_dim:
            return apply_rotary(heads, cos, sin, backend)
        rotated = apply_rotary(heads[..., : self.rotary_dim].contiguous(), cos, sin, backend)
        return torch.cat((rotated, heads[..., self.rotary_dim :]), dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.intermediate_size = size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """``backend`` is the engine's kernel backend; these matmuls and SiLU take no other."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    # (LayerSpec or None,), read at the first decodes-only step
    _decode_layer_spec: tuple | None = None

    def __init__(
        self, config, options: AttentionOptions, window: int | None = None, mlp=None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, options, window)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)  # a MoE block in MoE models
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rotary, hidden, residual, kv_cache, metadata):
        """``(mlp output, residual stream before it)``: the next layer's norm adds the two, so
        each residual add is fused with the norm after it. The first layer gets ``residual``
        None and starts the stream."""
        spec = self._layer_spec(metadata)
        attention = self.self_attn
        if spec is not None and fused_layer.fits(
            spec, hidden, rotary, kv_cache, metadata, attention.num_heads
        ):
            norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
            return fused_layer.decode_layer(
                spec, hidden, residual, norms, self.input_layernorm.eps, rotary, kv_cache,
                metadata, attention.num_heads, attention.scale,
            )  # fmt: skip
        backend = metadata.backend
        if residual is None:
            hidden, residual = self.input_layernorm(hidden, None, backend), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, backend)
        hidden = self.self_attn(rotary, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual, backend)
        return self.mlp(hidden, backend), residual

    def _layer_spec(self, metadata) -> fused_layer.LayerSpec | None:
        """The layer as one ``decode_layer`` call takes it in this step, or None."""
        if metadata.backend != "torch" or not metadata.decodes_only:
            return None
        if torch.compiler.is_compiling():
            spec = self._read_layer_spec()  # traced once
        else:
            cached = self._decode_layer_spec
            if cached is None:
                cached = self._decode_layer_spec = (self._read_layer_spec(),)
            spec = cached[0]
        if spec is None or (self.self_attn.window is not None and metadata.past_window):
            return None
        return spec

    def _read_layer_spec(self) -> fused_layer.LayerSpec | None:
        """A Llama layer of plain RMSNorms and SiLU MLP, whose attention
        ``decode_attention_qkv`` computes but for a window, with linear layers the call
        describes; read at the first decodes-only step (the engine replaces linear layers, by
        packing them or wrapping them for LoRA, and picks their kernels at load, before it)."""
        attention, mlp = self.self_attn, self.mlp
        if not (
            type(mlp) is LlamaMLP
            and type(self.input_layernorm) is RMSNorm
            and type(self.post_attention_layernorm) is RMSNorm
            and self.input_layernorm.eps == self.post_attention_layernorm.eps
            and attention.fuses_qkv()
        ):
            return None
        return fused_layer.layer_spec(
            attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
        )


# checkpoint name fragment -> (our parameter, index of the shard in a fused weight)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    # (LayerStack or None,), read at the first eager decodes-only step
    _decode_stack: tuple | None = None

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(
                f"--model: hidden_act {config.hidden_act!r}; the Llama-family blocks compute SiLU"
            )
        self.rotary = RotaryEmbedding(rotary_dim_of(config), rope_parameters(config), config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        options = self.attention_options(config)
        windows = layer_windows(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, options, w, self.build_mlp(config, index))
            for index, w in enumerate(windows)
        )
        # the shortest attention window of a layer (None: every layer attends to all)
        self.min_sliding_window = min(filter(None, windows), default=None)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # shared by every layer
        rotary = self.rotary.cos_sin(positions, hidden.dtype, metadata.rope_long_rows)
        stack = self._layer_stack(metadata)
        # every layer's caches have layer 0's shape and dtype (ModelRunner.allocate_kv_cache)
        fits = stack is not None and fused_layer.fits(
            stack, hidden, rotary, kv_caches[0], metadata, stack.num_heads
        )
        if fits:
            hidden, residual = fused_layer.decode_layers(stack, hidden, rotary, kv_caches, metadata)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(rotary, hidden, residual, kv_cache, metadata)
        return self.norm(hidden, residual, metadata.backend)[0]  # [num_tokens, hidden_size]

    def _layer_stack(self, metadata) -> fused_layer.LayerStack | None:
        """Every layer in one ``decode_layers`` call in this step, or None. Eager steps only: a
        compiled graph calls each layer's ``decode_layer``, and inductor's C++ wrapper already
        runs those calls with no Python between them."""
        if (
            metadata.backend != "torch"
            or not metadata.decodes_only
            or torch.compiler.is_compiling()
        ):
            return None
        cached = self._decode_stack
        if cached is None:  # read as the layers read theirs
            cached = self._decode_stack = (self._read_layer_stack(),)
        stack = cached[0]
        if stack is None or (stack.windowed and metadata.past_window):
            return None
        return stack

    def _read_layer_stack(self) -> fused_layer.LayerStack | None:
        """The layers as one stack where each is a ``LlamaDecoderLayer`` taking ``decode_layer``
        and they share the norms' eps and the attention's heads and scale."""
        layers = list(self.layers)
        if not layers or any(
            type(layer).forward is not LlamaDecoderLayer.forward for layer in layers
        ):
            return None
        attentions = [layer.self_attn for layer in layers]
        norms = [
            n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        if (
            len({(a.num_heads, a.scale) for a in attentions}) != 1
            or len({n.eps for n in norms}) != 1
        ):
            return None
        return fused_layer.layer_stack(
            [layer._read_layer_spec() for layer in layers], [n.weight for n in norms], norms[0].eps,
            attentions[0].num_heads, attentions[0].scale,
            any(a.window is not None for a in attentions),
        )  # fmt: skip

    def build_mlp(self, config, index: int) -> nn.Module:
        """Layer ``index``'s MLP: the dense SiLU MLP (MoE models build their experts here)."""
        return LlamaMLP(config)

    @property
    def long_rope_from(self) -> int | None:
        """Longrope: a request of more tokens than this takes the long factors in every row
        (``Request.rope_long``; the scheduler recomputes one that grows past it)."""
        return self.rotary.long_from

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [num_selected_tokens, vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())  # a tied lm_head is not listed apart
        tied = self.config.tie_word_embeddings
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (tied and name == "lm_head.weight"):
                continue
            if self.load_other_weight(name, tensor):
                continue
            target, shard = name, None
            for fragment, (fused, index) in _FUSED_SHARDS.items():
                if f".{fragment}." in name:
                    target, shard = name.replace(fragment, fused), index
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            self._copy_weight(params[target], tensor, shard, target)
            loaded.add(target)
        missing = set(params) - loaded - self.loaded_other_weights()
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")

    def load_other_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether a subclass loaded checkpoint weight ``name`` its own way (MoE experts)."""
        return False

    def loaded_other_weights(self) -> set[str]:
        """The parameters ``load_other_weight`` loaded whole."""
        return set()

    def _copy_weight(self, param, tensor, shard: int | None, name: str) -> None:
        with torch.no_grad():
            if shard is None:
                param.copy_(tensor)
                return
            sizes = self._shard_sizes(name)
            start = sum(sizes[:shard])
            param[start : start + sizes[shard]].copy_(tensor)

    def _shard_sizes(self, name: str) -> list[int]:
        if "qkv_proj" in name:
            attn = self.layers[0].self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        mlp = self.get_submodule(name.rsplit(".", 2)[0])  # the MLP holding gate_up_proj
        return [mlp.intermediate_size] * 2
