"""The correctness oracle: greedy output equals Transformers' token for token, in any batch."""

from __future__ import annotations

import pytest
from engine_utils import hf_greedy, make_core, run_to_completion
from tiny_models import TINY_DECODER, save_tiny_model

from llmrpc.engine.request import SamplingParams

PROMPT_TEXTS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Explain gravity to a child in two sentences, please.",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker "
    "who had never once left his workshop. One morning, a letter arrived",
    "def fibonacci(n):",
]


def _chat_prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        for text in PROMPT_TEXTS
    ]


def _as_ids(encoded) -> list[int]:
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


FAMILIES = {
    # Llama 3.1-style: llama3 rope scaling, untied embeddings, larger rope theta
    "llama3": (
        "llama",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-linear-rope": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("mistral", {"sliding_window": None, "tie_word_embeddings": False}),
    # Phi-3: fused q/k/v and gate/up in the checkpoint; Phi-4-mini: rotary over 3/4 of a head
    "phi3": ("phi3", {"tie_word_embeddings": False, "original_max_position_embeddings": 512}),
    "phi4-mini": (
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "tie_word_embeddings": True,
            "original_max_position_embeddings": 512,
        },
    ),  # fmt: skip
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory, smollm2_dir):
    model_type, overrides = FAMILIES[request.param]
    out_dir = tmp_path_factory.mktemp(request.param)
    config = {**TINY_DECODER, **overrides}
    return save_tiny_model(
        out_dir, smollm2_dir, model_type, randomize_biases_and_norms=True, **config
    )


def test_every_native_family_matches_transformers(family_dir):
    check_concurrent_greedy(family_dir)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "smollm2_dir"])
def test_concurrent_greedy_matches_transformers(request, model_fixture):
    check_concurrent_greedy(request.getfixturevalue(model_fixture))


def test_partial_rotary_on_the_triton_backend(tmp_path, smollm2_dir):
    """Phi-4-mini's rotary over part of each head through the Triton kernels (interpreted)."""
    model_type, overrides = FAMILIES["phi4-mini"]
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type, randomize_biases_and_norms=True,
                                **{**TINY_DECODER, **overrides})  # fmt: skip
    check_concurrent_greedy(model_dir, attention_backend="triton", num_prompts=3)


def check_concurrent_greedy(model_dir, num_prompts: int | None = None, **options):
    core = make_core(model_dir, max_num_batched_tokens=64, **options)
    prompts = [_as_ids(p) for p in _chat_prompts(core.tokenizer)][:num_prompts]
    assert len({len(p) for p in prompts}) >= min(8, len(prompts))  # mixed lengths share batches
    max_new_tokens = 24
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = run_to_completion(
        core, {f"r{i}": (prompt, params) for i, prompt in enumerate(prompts)}
    )
    expected = hf_greedy(model_dir, prompts, max_new_tokens)
    for i, want in enumerate(expected):
        assert outputs[f"r{i}"].token_ids == want, f"prompt {i} differs"
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
