"""Random-weight models of any Transformers architecture, saved with a real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmrpc.engine.loading.loader import load_tokenizer

# A decoder small enough to run in milliseconds: grouped-query attention 4/2.
TINY_DECODER: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def save_tiny_model(
    out_dir: Path,
    tokenizer_dir: Path,
    model_type: str,
    *,
    seed: int = 0,
    randomize_biases_and_norms: bool = False,
    **config: Any,
) -> Path:
    """Save a float32 ``model_type`` causal LM built from ``config``, with the tokenizer of
    ``tokenizer_dir``, to ``out_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = load_tokenizer(tokenizer_dir)
    hf_config = AutoConfig.for_model(
        model_type,
        **config,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # a fixed seed without touching the global RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config).to(torch.float32)
        if randomize_biases_and_norms:
            _randomize_biases_and_norms(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _randomize_biases_and_norms(model) -> None:
    """Transformers initialises biases to 0 and norms to 1, which would hide a dropped bias."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1 + 0.1 * torch.randn_like(param))
        elif name.endswith(".bias"):
            param.copy_(0.1 * torch.randn_like(param))


MOE_FAMILIES = {
    # 4 experts, top-2, always renormalised
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # a dense layer (mlp_only_layers) then a sparse one with a gated shared expert; top-k
    # weights not renormalised
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96, "mlp_only_layers": [0],
            "norm_topk_prob": False,
        },
    ),
    # per-head q/k norms; renormalised top-k; sparse every layer
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "head_dim": 32, "norm_topk_prob": True,
        },
    ),
    # q and k normed over their whole projections; q, k, v clipped at 0.5 (which bites at
    # these random weights)
    "olmoe": (
        "olmoe",
        {"num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 0.5, "norm_topk_prob": False},
    ),
}  # fmt: skip


def save_moe(tmp_path, smollm2_dir, family: str, **overrides) -> Path:
    """A tiny ``family`` MoE model (``MOE_FAMILIES``) with random routers, norms and biases
    (Transformers zeroes OLMoE's router at init, which would send every token to the first
    experts), so that every family routes tokens over all its experts."""
    model_type, config = MOE_FAMILIES[family]
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type, randomize_biases_and_norms=True,
                                **{**TINY_DECODER, **config, **overrides})  # fmt: skip
    _randomize_routers(model_dir)
    return model_dir


def _randomize_routers(model_dir) -> None:
    """Routers of spread logits (std 1 over the hidden size), rewritten in the saved file."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 - test helpers only

    path = next(model_dir.glob("*.safetensors"))
    weights = load_file(path)
    generator = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            noise = torch.randn(tensor.shape, generator=generator)
            weights[name] = noise / tensor.shape[1] ** 0.5
    save_file(weights, path, metadata={"format": "pt"})
