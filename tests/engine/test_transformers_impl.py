"""``--model-impl transformers``: Transformers' models on our scheduler and paged KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import hf_greedy, run_to_completion
from tiny_models import save_tiny_model

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.loading.loader import iter_weights, load_hf_config
from llmrpc.engine.models import build_model, model_class
from llmrpc.engine.models.transformers_impl import TransformersForCausalLM
from llmrpc.engine.request import InvalidRequestError, SamplingParams

PROMPT_TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers: 2, 3,",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Explain gravity to a child in two sentences, please.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker "
    "who had never once left his workshop. One morning, a letter arrived " * 3,
    "def fibonacci(n):",
]

# Weights drawn 10x wider than the default: with std 0.02 these tiny models echo one token whatever
# attention does, so a wrong attention scale or position would go unnoticed.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512, "initializer_range": 0.2},
    "opt": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "ffn_dim": 128,
        "word_embed_proj_dim": 64,
        "max_position_embeddings": 512,
        "init_std": 0.2,
        "tie_word_embeddings": False,  # GPT-2 covers tied embeddings
    },
    "mistral": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "sliding_window": 16,
    },
}


def make_tiny_hf_model_dir(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, model_type: str
) -> Path:
    """Save a random-weight float32 ``model_type`` causal LM with the SmolLM2 tokenizer."""
    out_dir = tmp_path_factory.mktemp(f"tiny-{model_type}")
    return save_tiny_model(out_dir, tokenizer_dir, model_type, **TINY_CONFIGS[model_type])


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory, smollm2_dir, "gpt2")


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_hf_model_dir(tmp_path_factory, smollm2_dir, "opt")


@pytest.fixture(scope="session")
def wide_llama_dir(tiny_model_factory) -> Path:
    """The tiny Llama (GQA 4/2, tied embeddings) with weights as wide as TINY_CONFIGS'."""
    return tiny_model_factory(initializer_range=0.2)


def _core(
    model_dir: Path,
    model_impl: str,
    max_num_batched_tokens: int = 32,
    max_model_len: int | None = 512,
) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(
                model=str(model_dir),
                dtype="float32",
                max_model_len=max_model_len,
                model_impl=model_impl,
            ),
            cache=CacheConfig(num_gpu_blocks_override=256),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        )
    )


def _record_batches(core: EngineCore) -> list:
    """(tokens computed before, new tokens) of each request in every step the runner prepares."""
    seen = []
    prepare = core.runner.prepare_input

    def spy(output, *args, **kwargs):
        seen.append(
            [(request.num_computed_tokens, num_new) for request, num_new in output.scheduled]
        )
        return prepare(output, *args, **kwargs)

    core.runner.prepare_input = spy
    return seen


def _mixes_chunks_and_decodes(step) -> bool:
    """A step with decodes beside a prompt chunk that continues an earlier chunk."""
    continued = any(computed > 0 and num_new > 1 for computed, num_new in step)
    return continued and any(num_new == 1 for _, num_new in step)


@pytest.mark.parametrize(
    ("model_fixture", "model_impl"),
    [("tiny_gpt2_dir", "auto"), ("tiny_opt_dir", "auto"), ("wide_llama_dir", "transformers")],
)
def test_concurrent_greedy_matches_transformers(request, model_fixture, model_impl):
    model_dir = request.getfixturevalue(model_fixture)
    core = _core(model_dir, model_impl)
    assert isinstance(core.model, TransformersForCausalLM)
    prompts = [core.tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]
    assert len({len(p) for p in prompts}) >= 8  # mixed lengths share batches
    batches = _record_batches(core)
    max_new_tokens = 24
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = run_to_completion(
        core, {f"r{i}": (prompt, params) for i, prompt in enumerate(prompts)}
    )
    assert any(_mixes_chunks_and_decodes(m) for m in batches)
    expected = hf_greedy(model_dir, prompts, max_new_tokens)
    for i, want in enumerate(expected):
        assert outputs[f"r{i}"].token_ids == want, f"prompt {i} differs"
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_native_impl_refuses_an_architecture_it_lacks(tiny_gpt2_dir):
    with pytest.raises(ValueError, match="--model-impl vllm"):
        _core(tiny_gpt2_dir, "vllm")


def test_auto_prefers_the_native_model(tiny_llama_dir):
    hf_config = load_hf_config(tiny_llama_dir)
    assert model_class(hf_config, "auto") is not TransformersForCausalLM
    assert model_class(hf_config, "vllm") is model_class(hf_config, "auto")
    assert model_class(hf_config, "transformers") is TransformersForCausalLM


def test_unknown_model_impl_names_the_flag():
    with pytest.raises(ValueError, match="--model-impl"):
        ModelConfig(model_impl="sglang")


def test_refuses_models_whose_attention_bypasses_the_interface():
    from transformers import BloomConfig

    # Bloom computes attention (with ALiBi) itself: it could never read our cache.
    with pytest.raises(ValueError, match="--model-impl transformers.*attention interface"):
        model_class(BloomConfig(hidden_size=64, n_layer=2, n_head=4), "auto")


def test_loads_legacy_checkpoint_names(tiny_gpt2_dir):
    """Hub GPT-2 checkpoints omit the ``transformer.`` prefix and carry causal-mask buffers."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, dtype=torch.float32)
    state = {k.removeprefix("transformer."): v for k, v in reference.state_dict().items()}
    state.pop("lm_head.weight")  # tied to wte
    state["h.0.attn.bias"] = torch.ones(1, 1, 512, 512, dtype=torch.bool)
    model = TransformersForCausalLM(reference.config)
    model.load_weights(state.items())
    for name, param in reference.named_parameters():
        assert torch.equal(model.model.get_parameter(name), param), name
    with pytest.raises(ValueError, match="missing"):
        TransformersForCausalLM(reference.config).load_weights(list(state.items())[1:])


def test_the_sliding_window_bounds_the_context(tmp_path_factory, smollm2_dir):
    model_dir = make_tiny_hf_model_dir(tmp_path_factory, smollm2_dir, "mistral")
    core = _core(model_dir, "transformers", max_model_len=None)
    assert core.max_model_len == 16  # the model's attention window
    params = SamplingParams(temperature=0.0, max_tokens=4)
    short = run_to_completion(core, {"short": (list(range(10, 20)), params)})
    assert len(short["short"].token_ids) == 4  # 14 tokens: the window covers them all
    with pytest.raises(InvalidRequestError):  # refused up front, not cut off mid-way
        run_to_completion(core, {"long": (list(range(10, 30)), params)})


def test_bfloat16_keeps_rotary_frequencies_as_transformers_does(wide_llama_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(wide_llama_dir, dtype=torch.bfloat16)
    model = build_model(
        load_hf_config(wide_llama_dir),
        torch.bfloat16,
        iter_weights(wide_llama_dir),
        model_impl="transformers",
    )
    ours = dict(model.model.named_buffers())
    for name, buffer in reference.named_buffers():
        assert ours[name].dtype == buffer.dtype and torch.equal(ours[name], buffer), name
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
