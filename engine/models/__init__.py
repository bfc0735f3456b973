"""Model implementations, chosen by the ``architectures`` entry of the model's config."""

from __future__ import annotations

import torch
from torch import nn

from llmrpc.engine.models.bert import BertModel
from llmrpc.engine.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextOfConditionalGeneration,
)
from llmrpc.engine.models.llama import LlamaForCausalLM
from llmrpc.engine.models.moe import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
    unstack_experts,
)
from llmrpc.engine.models.qwen import Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from llmrpc.engine.models.transformers_impl import TransformersForCausalLM
from llmrpc.engine.quantization.plan import QuantizationPlan

NATIVE_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3TextOfConditionalGeneration,  # its text model
    # encoders: pooling only (engine/pooling/params.py ENCODER_ARCHITECTURES)
    "BertModel": BertModel,
    "BertForMaskedLM": BertModel,
    "BertForPreTraining": BertModel,
}


def model_class(hf_config, model_impl: str = "auto") -> type[nn.Module]:
    """``model_impl`` is ``--model-impl``: "vllm" (native), "transformers", or "auto" (either)."""
    architectures = getattr(hf_config, "architectures", None) or []
    native = next((NATIVE_MODELS[name] for name in architectures if name in NATIVE_MODELS), None)
    text_part_of = getattr(hf_config, "text_part_of", None)
    if text_part_of and model_impl == "transformers":
        raise ValueError(
            f"--model-impl transformers: {text_part_of} is served as its text model, natively "
            "only; use --model-impl auto or vllm"
        )
    if model_impl == "transformers" or (model_impl == "auto" and native is None):
        TransformersForCausalLM.check_supported(hf_config)
        return TransformersForCausalLM
    if native is None:
        raise ValueError(
            f"--model-impl {model_impl}: architecture {architectures or '(none)'} has no native "
            f"implementation ({', '.join(sorted(NATIVE_MODELS))}); use --model-impl transformers"
        )
    return native


def build_model(
    hf_config,
    dtype,
    weights,
    seed: int = 0,
    model_impl: str = "auto",
    quantization: QuantizationPlan | None = None,
) -> nn.Module:
    """The model ``model_impl`` picks; ``weights`` None: random (``--load-format dummy``).

    ``quantization`` (``plan_quantization(model_config)``) swaps the loaded layers for packed
    ones before the rest is cast to ``dtype``, so the float weights are freed, not kept.
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(hf_config, model_impl)(hf_config)
    if weights is not None:
        model.load_weights(weights)
    if quantization is not None:
        unstack_experts(model)  # quantized as the linear layers they become
        model = quantization.apply(model, hf_config, dtype)
    return model.to(dtype).eval().requires_grad_(False)
