"""Gemma 2 and Gemma 3 text models (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``) on the paged
KV cache: Llama's attention, local (sliding-window) and global layers as ``layer_types`` says;
norms before and after attention and the MLP, a GELU (tanh) MLP, embeddings scaled by the square
root of the hidden size, final logits soft-capped where the config says. Gemma 3 adds q/k norms
and a rotary base for each kind of layer; Gemma 2 soft-caps the attention scores instead.

Gemma's RMSNorm multiplies by ``1 + weight``: the loader adds the 1, so the Llama norm serves
(in float32 the same numbers; in 16 bits Gemma rounds after the product, Llama before it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmrpc.engine.models.llama import (
    AttentionOptions,
    LlamaAttention,
    LlamaForCausalLM,
    RMSNorm,
    head_dim_of,
    layer_windows,
)
from llmrpc.engine.models.rotary import RotaryEmbedding, rope_parameters


class GemmaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, window: int | None, qk_norm: bool = True) -> None:
        super().__init__()
        self.is_sliding = window is not None
        self.self_attn = LlamaAttention(config, AttentionOptions(qk_norm=qk_norm), window)
        self.self_attn.scale = config.query_pre_attn_scalar**-0.5
        self.self_attn.softcap = getattr(config, "attn_logit_softcapping", None) or None
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(self, rotary, hidden, kv_cache, metadata) -> torch.Tensor:
        backend = metadata.backend
        out = self.self_attn(
            rotary, self.input_layernorm(hidden, None, backend), kv_cache, metadata
        )
        hidden = hidden + self.post_attention_layernorm(out, None, backend)
        out = self.mlp(self.pre_feedforward_layernorm(hidden, None, backend))
        return hidden + self.post_feedforward_layernorm(out, None, backend)


class Gemma3ForCausalLM(LlamaForCausalLM):
    family = "Gemma 3"
    qk_norm = True

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        refused = (
            # Transformers' Gemma 3 reads no attention cap
            (self.qk_norm and getattr(config, "attn_logit_softcapping", None), "an attention cap"),
            (getattr(config, "use_bidirectional_attention", False), "use_bidirectional_attention"),
            (activation != "gelu_pytorch_tanh", "a hidden_activation but GELU-tanh"),
        )
        for set_, what in refused:
            if set_:
                raise ValueError(f"--model: {self.family} with {what} is not served natively")
        self.config = config
        params = rope_parameters(config)
        head_dim = head_dim_of(config)
        # the rotary of each kind of layer (Transformers keeps rope_parameters by layer type)
        self.rotaries = nn.ModuleDict(
            {
                kind: RotaryEmbedding(head_dim, rope_parameters_of(params, kind), config)
                for kind in ("sliding_attention", "full_attention")
            }
        )
        if any(rotary.long_from is not None for rotary in self.rotaries.values()):
            raise ValueError(f"--model: {self.family} with longrope scaling is not served natively")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        windows = layer_windows(config)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, w, self.qk_norm) for w in windows)
        self.min_sliding_window = min(filter(None, windows), default=None)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.softcap = getattr(config, "final_logit_softcapping", None)

    @property
    def long_rope_from(self) -> None:
        return None  # longrope is refused above

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        rotary = {
            kind: rotary.cos_sin(positions, hidden.dtype) for kind, rotary in self.rotaries.items()
        }  # shared by the layers of each kind
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            kind = "sliding_attention" if layer.is_sliding else "full_attention"
            hidden = layer(rotary[kind], hidden, kv_cache, metadata)
        return self.norm(hidden, None, metadata.backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        with torch.no_grad():  # Gemma's norms scale by 1 + weight
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(1.0)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's layers without q/k norms, one rotary base, attention scores capped at
    ``attn_logit_softcapping``."""

    family = "Gemma 2"
    qk_norm = False


class Gemma3TextOfConditionalGeneration(Gemma3ForCausalLM):
    """The text model of ``Gemma3ForConditionalGeneration`` (``loader.load_hf_config`` gives it
    the text config): the checkpoint's language-model weights (``model.language_model.*``, or
    ``language_model.model.*`` in older checkpoints); the vision tower's and the projector's are
    skipped."""

    _SKIPPED = ("vision_tower.", "multi_modal_projector.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def text_weights():
            for name, tensor in weights:
                bare = name.removeprefix("model.")
                if not bare.startswith(self._SKIPPED):
                    yield bare.removeprefix("language_model."), tensor

        super().load_weights(text_weights())


def rope_parameters_of(params: dict, kind: str) -> dict:
    """One kind of layer's rope settings: Transformers keeps them by layer type."""
    own = params.get(kind)
    if not isinstance(own, dict):
        return params
    own = dict(own)
    own["rope_type"] = own.get("rope_type", own.get("type", "default"))
    return own
