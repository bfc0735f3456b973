"""Model sources and dtypes as a user starts them: packaged default, dummy weights, bf16/fp16."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_core, run_to_completion

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.request import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _chat(core) -> list[int]:
    text = core.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return core.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("dtype", ["auto", "float16"])
def test_packaged_default_answers_in_half_precision(smollm2_dir, dtype):
    """Its answer begun, the half-precision model names Paris (float32 does by 4.6 nats), and its
    first token's top log-probabilities are float32's within half precision's rounding. Not a
    free greedy answer: there float32's top two first tokens lie 0.08 nats apart, so which one a
    half-precision run takes turns on the last bits of whichever kernels were measured fastest."""
    core = make_core(smollm2_dir, dtype=dtype, max_model_len=1024, num_blocks=128)
    assert core.dtype == {"auto": torch.bfloat16, "float16": torch.float16}[dtype]
    reference = make_core(smollm2_dir, dtype="float32", max_model_len=1024, num_blocks=128)
    answer = core.tokenizer.encode("The capital of France is", add_special_tokens=False)
    begun = _chat(core) + answer
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    assert run_to_completion(core, {"q": (begun, greedy)})["q"].text == " Paris"
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    (half,) = run_to_completion(core, {"q": (_chat(core), params)})["q"].logprobs
    (full,) = run_to_completion(reference, {"q": (_chat(core), params)})["q"].logprobs
    assert {t for t, _ in half.top} == {t for t, _ in full.top}
    expected = dict(full.top)
    for token, logprob in half.top:
        assert abs(logprob - expected[token]) < 0.35, (token, logprob, expected[token])


def test_default_model_is_the_packaged_smollm2(smollm2_dir, monkeypatch):
    monkeypatch.setenv("LLMRPC_CACHE_DIR", str(smollm2_dir.parent.parent))
    config = EngineConfig(
        model=ModelConfig(max_model_len=256, load_format="dummy"),
        cache=CacheConfig(num_gpu_blocks_override=16),
    )
    core = EngineCore(config)
    assert core.served_model_names == ("SmolLM2-135M-Instruct",)
    assert core.hf_config.num_hidden_layers == 30


ROWS = torch.arange(64)  # the embedding's first rows, read as the model reads them


def test_dummy_weights_are_random_but_seeded(tiny_llama_dir):
    def first_weight(seed):
        config = EngineConfig(
            model=ModelConfig(str(tiny_llama_dir), load_format="dummy", seed=seed),
            cache=CacheConfig(num_gpu_blocks_override=64),
        )
        return EngineCore(config).model.embed_tokens(ROWS).clone()

    real = make_core(tiny_llama_dir).model.embed_tokens(ROWS)
    assert torch.equal(first_weight(1), first_weight(1))
    assert not torch.equal(first_weight(1), first_weight(2))
    assert not torch.equal(first_weight(1), real)


def test_max_model_len_beyond_the_model_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="--max-model-len"):
        make_core(tiny_llama_dir, max_model_len=100_000)
