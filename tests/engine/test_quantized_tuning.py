"""Up to how many rows each quantized layer runs its packed kernel, measured at load
(engine/quantization/tuning.py): the rule, the measurement on real layers, its cache, and an
engine's report of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.quantization import tuning
from llmrpc.engine.quantization.layers import Int4Linear, Int8Linear, QuantizedLinear
from llmrpc.engine.quantization.tuning import ANY_ROWS, DENSE, PACKED, dense_above
from llmrpc.kernels.linear_tuning import ROW_BUCKETS

NONE = [None] * len(ROW_BUCKETS)


def _choice(packed, dense):
    return tuning._choose("s", 2, {PACKED: packed, DENSE: dense}, tied=False, uniform=False)


def test_the_packed_kernel_serves_up_to_the_first_bucket_it_loses():
    choice = _choice([1, 2, 3, 9, 30, None], [5, 5, 5, 6, 7, None])
    assert choice.kernels == (PACKED,) * 3 + (DENSE,) * 3
    assert dense_above(choice) == 32
    # packed again past the loss: not taken (the threshold is one number of rows)
    assert dense_above(_choice([1, 2, 9, 1, 1, 1], [5, 5, 5, 5, 5, 5])) == 8
    # never beaten, later buckets untimed: any number of rows
    assert dense_above(_choice([1, 2, None, None, None, None], [5, 5] + NONE[2:])) == ANY_ROWS
    assert dense_above(_choice([9, 9, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5])) == 0


class _Layers(nn.Module):
    def __init__(self, dtype=torch.bfloat16) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.int4 = nn.ModuleList(
            Int4Linear.from_float(torch.randn(128, 64, generator=gen), dtype=dtype)
            for _ in range(3)
        )
        self.int8 = Int8Linear.from_float(torch.randn(96, 64, generator=gen), dtype=dtype)


def test_each_shape_is_timed_and_its_layers_take_the_threshold(tmp_path):
    model = _Layers()
    plan = tuning.plan_quantized_kernels(model, tmp_path)
    assert set(plan) == {tuning.shape_key(model.int4[0]), tuning.shape_key(model.int8)}
    for layer in (*model.int4, model.int8):
        choice = plan[tuning.shape_key(layer)]
        assert layer.dense_above == dense_above(choice)
        assert choice.times_us[PACKED][0] > 0 and choice.times_us[DENSE][0] > 0
    assert plan[tuning.shape_key(model.int4[0])].num_layers == 3


def test_a_second_start_reads_the_cache(tmp_path, monkeypatch):
    first = tuning.plan_quantized_kernels(_Layers(), tmp_path)
    (saved,) = tmp_path.glob("quantized-*.json")

    def no_timing(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(tuning, "FAMILY", dataclasses.replace(tuning.FAMILY, time=no_timing))
    assert tuning.plan_quantized_kernels(_Layers(), tmp_path) == first
    assert saved.exists()


def test_float32_layers_always_dequantize_and_are_not_timed(tmp_path):
    model = _Layers(torch.float32)
    assert tuning.plan_quantized_kernels(model, tmp_path) == {}
    assert not list(tmp_path.glob("quantized-*.json"))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_an_engine_measures_its_quantized_layers_and_reports_them(tiny_llama_dir, method):
    model = ModelConfig(model=str(tiny_llama_dir), dtype="bfloat16", quantization=method)
    core = EngineCore(EngineConfig(model=model, cache=CacheConfig(num_gpu_blocks_override=64)))
    layers = [m for m in core.model.modules() if isinstance(m, QuantizedLinear)]
    reported = core.linear_kernels
    assert {tuning.shape_key(layer) for layer in layers} <= set(reported)
    for layer in layers:
        assert layer.dense_above == dense_above(reported[tuning.shape_key(layer)])
    shapes = {choice.shape for choice in reported.values() if choice.layout == tuning.LAYOUT}
    assert shapes == {tuning.shape_key(layer) for layer in layers}
