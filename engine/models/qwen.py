"""Qwen2/2.5 (biased q/k/v projections) and Qwen3 (q/k RMSNorm): Llama with other attention."""

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
