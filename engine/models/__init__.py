"""Model implementations, chosen by the ``architectures`` entry of the model's config."""

from __future__ import annotations

import torch
from torch import nn

from llmrpc.engine.models.llama import LlamaForCausalLM
from llmrpc.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

NATIVE_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(hf_config) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in NATIVE_MODELS:
            return NATIVE_MODELS[name]
    raise ValueError(
        f"--model: architecture {architectures or '(none)'} is not supported; "
        f"native implementations: {', '.join(sorted(NATIVE_MODELS))}"
    )


def build_model(hf_config, dtype, weights, seed: int = 0) -> nn.Module:
    """The native model; ``weights`` None gives random weights (``--load-format dummy``)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(hf_config)(hf_config)
    if weights is not None:
        model.load_weights(weights)
    return model.to(dtype).eval().requires_grad_(False)
