"""The Mixture-of-Experts families (engine/models/moe.py) against Transformers: greedy float32
tokens equal under pressure (chunked prefill, a prefix hit, preemptions) on both backends (Triton
interpreted), from per-expert checkpoints (what ``save_pretrained`` writes) and fused ones (what
Transformers 5 holds in memory), with dense and sparse layers mixed where the config says.

Routers, norms and biases are random (Transformers zeroes OLMoE's router at init, which would
send every token to the first experts) so that every family routes tokens over all its experts.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import hf_greedy, make_core
from test_greedy_matches_transformers import check_under_pressure
from tiny_models import TINY_DECODER, save_tiny_model

from llmrpc.engine.models.moe import MoeForCausalLM, SparseMoeBlock

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


def save_moe(tmp_path, smollm2_dir, family: str):
    model_type, overrides = MOE_FAMILIES[family]
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type, randomize_biases_and_norms=True,
                                **{**TINY_DECODER, **overrides})  # fmt: skip
    _randomize_routers(model_dir)
    return model_dir


def _randomize_routers(model_dir) -> None:
    """Routers of spread logits (std 1 over the hidden size), rewritten in the saved file."""
    from safetensors.torch import load_file, save_file

    path = next(model_dir.glob("*.safetensors"))
    weights = load_file(path)
    generator = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            noise = torch.randn(tensor.shape, generator=generator)
            weights[name] = noise / tensor.shape[1] ** 0.5
    save_file(weights, path, metadata={"format": "pt"})


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_families_under_pressure(tmp_path, smollm2_dir, family, backend):
    model_dir = save_moe(tmp_path, smollm2_dir, family)
    num_prompts = 9 if backend == "torch" else 4
    check_under_pressure(model_dir, num_prompts, 12 if backend == "torch" else 7,
                         attention_backend=backend)  # fmt: skip


def test_fused_expert_checkpoints_load(tmp_path, smollm2_dir):
    """A checkpoint holding the experts as Transformers 5 does in memory (``experts.gate_up_proj``
    ``[E, 2I, H]``, ``experts.down_proj``, ``mlp.gate``) serves the same tokens."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    per_expert = save_moe(tmp_path / "per-expert", smollm2_dir, "mixtral")
    model = AutoModelForCausalLM.from_pretrained(per_expert)
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused / name).write_bytes((per_expert / name).read_bytes())
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    expected = hf_greedy(per_expert, prompts, 8)
    from engine_utils import run_to_completion

    from llmrpc.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    for model_dir in (per_expert, fused):
        core = make_core(model_dir)
        blocks = [m for m in core.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == 2
        outputs = run_to_completion(core, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
        assert [outputs[f"r{i}"].token_ids for i in range(2)] == expected


def test_a_missing_expert_is_named(tmp_path, smollm2_dir):
    from safetensors.torch import load_file, save_file

    model_dir = save_moe(tmp_path, smollm2_dir, "qwen3_moe")
    path = next(model_dir.glob("*.safetensors"))
    weights = load_file(path)
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.experts\.w13"):
        make_core(model_dir)


def test_sparse_layers_follow_the_config(tmp_path, smollm2_dir):
    """Qwen's ``mlp_only_layers`` and ``decoder_sparse_step`` pick the sparse layers."""
    from llmrpc.engine.loading.loader import load_hf_config
    from llmrpc.engine.models import model_class

    model_dir = save_moe(tmp_path, smollm2_dir, "qwen2_moe")
    config = load_hf_config(model_dir)
    config.num_hidden_layers, config.mlp_only_layers, config.decoder_sparse_step = 6, [3], 2
    config.layer_types = ["full_attention"] * 6
    model = model_class(config)(config)
    assert isinstance(model, MoeForCausalLM)
    sparse = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == [1, 5]
