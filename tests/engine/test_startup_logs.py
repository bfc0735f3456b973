"""What the engine's start-up log says a new user: the linear layers' form, the thread count."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core import engine_core
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.runner.threads import ThreadBudget


def _load_messages(model_dir, caplog, **model) -> list[str]:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), max_model_len=512, **model),
        cache=CacheConfig(num_gpu_blocks_override=64),
    )
    with caplog.at_level(logging.INFO, logger="llmrpc.engine.core.engine_core"):
        EngineCore(config)
    return [r.getMessage() for r in caplog.records if "linear layers" in r.getMessage()]


def test_quantized_layers_are_reported_as_quantized_not_as_none_packed(tiny_llama_dir, caplog):
    (line,) = _load_messages(tiny_llama_dir, caplog, dtype="float32", quantization="int4")
    assert "quantized by --quantization int4" in line, line
    assert not line.startswith("0 "), line


def test_float_layers_are_reported_packed(tiny_llama_dir, caplog):
    (line,) = _load_messages(tiny_llama_dir, caplog, dtype="float32")
    assert "packed" in line and "quantized" not in line, line


@pytest.mark.parametrize("cores, expected", [(2, "1 CPU thread while"), (3, "2 CPU threads while")])
def test_the_thread_count_line_is_singular_for_one(monkeypatch, caplog, cores, expected):
    monkeypatch.setattr(engine_core, "idle_core_budget", lambda: ThreadBudget(cores))
    engine = SimpleNamespace(parallel=None, runner=SimpleNamespace(compiled_decode=None))
    with caplog.at_level(logging.INFO, logger="llmrpc.engine.core.engine_core"):
        assert EngineCore.use_idle_cores(engine)
    assert f"engine: {expected}" in caplog.text, caplog.text
