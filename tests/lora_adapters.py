"""PEFT LoRA adapters made in the tests, with PEFT itself, on a random-weight base model.

PEFT initialises ``lora_B`` to zero (an adapter that changes nothing); these get random,
non-trivial A and B so that every adapted projection changes the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ALL_TARGETS
    use_rslora: bool = False
    seed: int = 0
    scale: float = 0.2  # of the random A and B entries
    extra: dict = field(default_factory=dict)  # more LoraConfig fields


def _peft_model(base_dir: Path, spec: AdapterSpec):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        lora_dropout=0.0,
        **spec.extra,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(spec.scale * torch.randn(param.shape, generator=generator))
    return model.eval()


def make_adapter(base_dir: Path, out_dir: Path, spec: AdapterSpec):
    """Save the adapter ``spec`` describes to ``out_dir``; returns PEFT's merged model (the
    reference: the base weights plus the adapter's scaled B @ A)."""
    model = _peft_model(base_dir, spec)
    model.save_pretrained(out_dir)
    return model.merge_and_unload().eval()


def greedy_tokens(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """A Transformers model's greedy continuation of one prompt."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt) :].tolist()
