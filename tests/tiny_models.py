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
