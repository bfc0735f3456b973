"""The Mixture-of-Experts families (engine/models/moe.py) against Transformers: greedy float32
tokens equal under pressure (chunked prefill, a prefix hit, preemptions) on both backends (Triton
interpreted), from per-expert checkpoints (what ``save_pretrained`` writes) and fused ones (what
Transformers 5 holds in memory), with dense and sparse layers mixed where the config says.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import hf_greedy, make_core, run_to_completion
from test_greedy_matches_transformers import check_under_pressure
from tiny_models import MOE_FAMILIES, save_moe

from llmrpc.engine.models.moe import MoeForCausalLM, SparseMoeBlock


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


def test_compiled_and_speculative_steps_of_a_moe_model(tmp_path, smollm2_dir, cpp_decode_attention):
    """The experts under -O3 (one opaque operation in the compiled decode step) and under
    speculative decoding (several rows of one request verified in a step; drafts that follow
    the expected tokens, one made wrong in every other proposal): Transformers' greedy tokens."""
    import random

    from test_spec_decode import NGRAM, _RowsFree

    from llmrpc.engine.config import CompilationConfig
    from llmrpc.engine.request import SamplingParams
    from llmrpc.engine.spec_decode.config import SpeculativeConfig
    from llmrpc.engine.spec_decode.ngram import NgramProposer

    model_dir = save_moe(tmp_path, smollm2_dir, "qwen3_moe")
    core = make_core(model_dir, compilation=CompilationConfig({"level": 3}))
    prompts = [core.tokenizer.encode("one two three one two"), [5, 6, 7], list(range(5, 40))]
    expected = hf_greedy(model_dir, prompts, 24)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    requests = {f"r{i}": (p, params) for i, p in enumerate(prompts)}
    compiled = core.runner.compiled_decode
    assert compiled is not None and compiled.failure is None  # compiled at load
    calls, forward = [0], compiled._forward

    def counting(*args):
        calls[0] += 1
        return forward(*args)

    compiled._forward = counting
    outputs = run_to_completion(core, requests)
    assert [outputs[f"r{i}"].token_ids for i in range(3)] == expected
    assert calls[0] >= 20 and compiled.failure is None  # decode steps ran the compiled graph

    class Foreseeing(NgramProposer):
        """Drafts of the expected next tokens, every other proposal with one made wrong."""

        rng = random.Random(4)

        def propose(self, request, max_drafts: int, batch_size: int) -> list[int]:
            k = self.num_drafts(request, max_drafts, batch_size)
            index = prompts.index(list(request.prompt_token_ids))
            done = len(request.all_token_ids) - len(prompts[index])
            drafts = expected[index][done : done + k]
            if drafts and self.rng.random() < 0.5:
                drafts[self.rng.randrange(len(drafts))] += 1
            return drafts

    spec = make_core(model_dir)
    spec.proposer = spec.scheduler.proposer = Foreseeing(SpeculativeConfig(NGRAM))
    spec.proposer.cost = _RowsFree()
    outputs = run_to_completion(spec, requests)
    assert [outputs[f"r{i}"].token_ids for i in range(3)] == expected
    stats = spec.proposer.stats
    assert stats.accepted_per_pos[2] > 0 and stats.num_drafts > stats.accepted_per_pos[0]


def test_structured_output_holds_on_a_moe_model(tmp_path, smollm2_dir):
    """A JSON schema on a MoE model (random weights, so free output is noise): every seeded
    constrained sample in a batch mixed with free ones validates, and no free one parses."""
    import json

    import jsonschema
    from test_structured_output import SCHEMA, _parses

    from llmrpc.engine.request import FinishReason, SamplingParams, StructuredOutputSpec
    from llmrpc.engine.structured_output import grammar as structured_output

    core = make_core(save_moe(tmp_path, smollm2_dir, "qwen2_moe"))
    spec = structured_output.check(
        StructuredOutputSpec("json_schema", json.dumps(SCHEMA), any_whitespace=False), "xgrammar"
    )
    params = [SamplingParams(seed=s, max_tokens=160, structured_output=spec) for s in range(8)]
    params += [SamplingParams(seed=s, max_tokens=20) for s in range(3)]
    outputs = run_to_completion(core, {f"r{i}": ([1, 2, 3], p) for i, p in enumerate(params)})
    for i in range(8):
        assert outputs[f"r{i}"].finish_reason is FinishReason.EOS, outputs[f"r{i}"].text
        jsonschema.validate(json.loads(outputs[f"r{i}"].text), SCHEMA)
    assert not any(_parses(outputs[f"r{i}"].text) for i in range(8, 11))


def test_the_transformers_fallback_loads_per_expert_checkpoints(tmp_path, smollm2_dir):
    """--model-impl transformers on a checkpoint whose experts Transformers stacks as it loads
    (Mixtral's block_sparse_moe.experts.N.w1|w2|w3): its own conversion, its greedy tokens; a
    weight no conversion takes is named."""
    from safetensors.torch import load_file, save_file

    from llmrpc.engine.models.transformers_impl import TransformersForCausalLM
    from llmrpc.engine.request import SamplingParams

    model_dir = save_moe(tmp_path, smollm2_dir, "mixtral")
    core = make_core(model_dir, model_impl="transformers")
    assert isinstance(core.runner.model, TransformersForCausalLM)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = run_to_completion(core, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    assert [outputs[f"r{i}"].token_ids for i in range(2)] == hf_greedy(model_dir, prompts, 8)
    path = next(model_dir.glob("*.safetensors"))
    weights = load_file(path)
    weights["model.layers.0.block_sparse_moe.experts.0.w9.weight"] = torch.zeros(2, 2)
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected weight '.*experts\.0\.w9\.weight'"):
        make_core(model_dir, model_impl="transformers")


def test_batch_invariant_mode_refuses_moe_models_in_one_line(tmp_path, smollm2_dir):
    model_dir = save_moe(tmp_path, smollm2_dir, "mixtral")
    with pytest.raises(ValueError, match=r"^--batch-invariant does not cover MoE models"):
        make_core(model_dir, "bfloat16", batch_invariant=True)


def test_routers_compute_in_float32_in_a_bfloat16_model(tmp_path, smollm2_dir):
    """In bfloat16 the router's weight stays float32 and its logits are the float32 sums of the
    widened hidden states (not rounded to 16 bits); the model serves (Qwen2-MoE: its shared
    expert's gate too) with every other weight in bfloat16."""
    from llmrpc.engine.request import SamplingParams

    model_dir = save_moe(tmp_path, smollm2_dir, "qwen2_moe")
    core = make_core(model_dir, "bfloat16")
    block = core.runner.model.layers[1].mlp
    assert block.gate.weight.dtype == block.shared_expert_gate.weight.dtype == torch.float32
    x = torch.randn(5, block.gate.in_features, dtype=torch.bfloat16)
    exact = (x.double() @ block.gate.weight.double().T).float()
    torch.testing.assert_close(block.gate(x), exact, rtol=1e-6, atol=1e-6)
    assert block(x).dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = run_to_completion(core, {"r": ([5, 6, 7, 8], params)})
    assert len(outputs["r"].token_ids) == 8
