"""The decode roofline of ``llmrpc bench throughput --roofline``: the bytes a step reads, counted
from the engine's own packed layers against the checkpoint's tensors, and the line it prints
(the command itself: tests/clients/test_bench.py)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from torch import nn

from llmrpc.engine import roofline
from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore


def _checkpoint_bytes(model_dir) -> dict[str, int]:
    tensors = load_file(model_dir / "model.safetensors")
    return {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}


def _engine(model_dir, dtype: str = "float32") -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype),
        cache=CacheConfig(kv_cache_memory_gib=0.01),
    )
    return EngineCore(config)


def _rotary_bytes(core: EngineCore) -> int:
    return core.model.rotary.inv_freq.nbytes  # read a step too, like the weights


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_head_counts_the_table_once_in_full(tiny_llama_dir, dtype):
    sizes = _checkpoint_bytes(tiny_llama_dir)  # float32
    core = _engine(tiny_llama_dir, dtype)
    expected = sum(sizes.values()) // (1 if dtype == "float32" else 2) + _rotary_bytes(core)
    if isinstance(core.model.embed_tokens, nn.Embedding):
        # the head packed a copy of its own (oneDNN's layout); the embedding reads a row of its
        assert type(core.model.lm_head).__name__ == "PackedLinear"
        expected += core.model.embed_tokens.weight[0].nbytes
    else:  # the embedding reads its rows from the head's blocks: one table
        assert type(core.model.embed_tokens).__name__ == "RowsEmbedding"
    assert roofline.weight_bytes_per_step(core.model) == expected


def test_an_untied_embedding_counts_one_row(tiny_model_factory):
    model_dir = tiny_model_factory(tie_word_embeddings=False)
    sizes = _checkpoint_bytes(model_dir)
    core = _engine(model_dir)
    embedding = sizes["model.embed_tokens.weight"]
    one_row = embedding // core.hf_config.vocab_size
    expected = sum(sizes.values()) - embedding + one_row + _rotary_bytes(core)
    assert roofline.weight_bytes_per_step(core.model) == expected


def test_the_bound_and_its_line():
    bound = roofline.Roofline(
        bandwidth=20e9, threads=2, weight_bytes=200_000_000, kv_bytes_per_token=10_000,
        batch=4, context=500.0,
    )  # fmt: skip
    assert bound.step_bytes == 200_000_000 + 4 * 500 * 10_000
    assert bound.tokens_per_second == pytest.approx(4 * 20e9 / 220_000_000)
    line = bound.line(measured=bound.tokens_per_second / 2)
    assert line.startswith("roofline: read 20.0 GB/s on 2 threads")
    assert "220.0 MB" in line and line.endswith("= 50%")


def test_read_bandwidth_is_a_rate():
    rate = roofline.read_bandwidth(num_bytes=1 << 24, repeats=2)
    assert 1e8 < rate < 1e13  # between 0.1 GB/s and 10 TB/s: bytes over seconds, not either
