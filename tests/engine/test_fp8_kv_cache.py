"""``--kv-cache-dtype fp8`` / ``fp8_e5m2``: keys and values held in fp8 with per-layer scales.

Stated tolerance: on SmolLM2, the perplexity of a fixed text with an fp8 cache stays within 8% of
the same model's with a cache in its own dtype (measured: float32 +3.2% e4m3, +5.4% e5m2;
bfloat16 +5.1% e4m3, +2.8% e5m2). The cache holds twice (bfloat16) or four times (float32) the
blocks in the same memory, and both attention backends read it alike."""

from __future__ import annotations

import math

import pytest
import torch
from engine_utils import FIXED_TEXT, engine_perplexity, make_core, run_to_completion

from llmrpc.engine.config import CacheConfig, CompilationConfig, EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.request import SamplingParams


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_cache_keeps_smollm2s_perplexity_within_8_percent(smollm2_dir, dtype):
    perplexity = {}
    for kv_cache_dtype in ("auto", "fp8", "fp8_e5m2"):
        core = make_core(smollm2_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_blocks=64)
        expected = {"auto": core.dtype, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
        assert core.runner.kv_caches[0][0].dtype == expected[kv_cache_dtype]
        perplexity[kv_cache_dtype] = engine_perplexity(
            core, core.tokenizer(FIXED_TEXT)["input_ids"]
        )
    for kv_cache_dtype in ("fp8", "fp8_e5m2"):
        ratio = perplexity[kv_cache_dtype] / perplexity["auto"]
        assert abs(math.log(ratio)) < math.log(1.08), perplexity


def test_fp8_cache_holds_more_blocks_in_the_same_memory(tiny_llama_dir):
    def num_blocks(dtype: str, kv_cache_dtype: str) -> int:
        core = EngineCore(
            EngineConfig(
                model=ModelConfig(model=str(tiny_llama_dir), dtype=dtype, max_model_len=512),
                cache=CacheConfig(kv_cache_memory_gib=2**-6, cache_dtype=kv_cache_dtype),
            )
        )
        assert core.stats.kv_cache_bytes == 2**-6 * 2**30  # 16 MiB, whole blocks
        return core.kv_manager.num_blocks

    assert num_blocks("float32", "fp8") == 4 * num_blocks("float32", "auto")
    assert num_blocks("bfloat16", "fp8_e5m2") == 2 * num_blocks("bfloat16", "auto")


def test_both_backends_read_an_fp8_cache_alike(tiny_llama_dir):
    """And the Triton backend's compiled decode step (-O3), whose kernels store and read fp8
    in the graph, as its eager one."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {f"r{i}": [(13 * i + j) % 700 + 10 for j in range(2 + 11 * i)] for i in range(6)}
    tokens = {}
    for backend, level in (("torch", 0), ("triton", 0), ("triton", 3)):
        core = make_core(
            tiny_llama_dir,
            attention_backend=backend,
            kv_cache_dtype="fp8",
            max_num_batched_tokens=32,
            compilation=CompilationConfig({"level": level}),
        )
        compiled = core.runner.compiled_decode
        assert (compiled is not None) == (level > 0)
        outputs = run_to_completion(core, {k: (p, params) for k, p in prompts.items()})
        assert compiled is None or compiled.failure is None
        tokens[backend, level] = {k: o.token_ids for k, o in outputs.items()}
    assert tokens["triton", 0] == tokens["torch", 0]
    assert tokens["triton", 3] == tokens["triton", 0]


def test_fp8_inc_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_inc is for Intel Gaudi"):
        CacheConfig(cache_dtype="fp8_inc")
