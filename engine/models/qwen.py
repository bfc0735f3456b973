"""Qwen2/2.5 (biased q/k/v projections), Qwen3 (q/k RMSNorm) and Phi-3: Llama with other
attention, or other checkpoints."""

from __future__ import annotations

from llmrpc.engine.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5-mini and Phi-4-mini: Llama's blocks (rotary over ``partial_rotary_factor``
    of each head where the config says so); the checkpoint's q/k/v and gate/up projections
    come fused already, in the order ours are."""
