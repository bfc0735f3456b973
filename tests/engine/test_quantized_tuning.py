"""Where quantized layers stop using their packed kernel (engine/quantization/tuning.py): the
choice from the timings, the threshold it sets, the cache, and a model's layers tuned at load."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmrpc.engine.quantization import tuning
from llmrpc.engine.quantization.layers import (
    Int4Linear,
    blocked_kernel_available,
    tiles_available,
)
from llmrpc.kernels.linear_tuning import ROW_BUCKETS

N = len(ROW_BUCKETS)


def times(packed, dense):
    return {"packed": packed, "dense": dense}


def test_packed_for_the_leading_buckets_it_wins_then_dense():
    choice = tuning.choose("s", 3, times([1, 2, 3, 9, None, None], [5, 5, 5, 5, None, None]))
    assert choice.kernels == ("packed",) * 3 + ("dense",) * 3
    assert tuning.dense_above(choice) == 32  # the end of bucket 9-32


def test_a_later_win_does_not_reopen_the_packed_path():
    choice = tuning.choose("s", 1, times([1, 9, 1, 1, 1, 1], [5, 5, 5, 5, 5, 5]))
    assert choice.kernels == ("packed",) + ("dense",) * (N - 1)
    assert tuning.dense_above(choice) == 1


def test_untimed_buckets_take_the_last_timed_choice():
    packed_throughout = tuning.choose("s", 1, times([1, 1, None, None, None, None],
                                                    [2, 2, None, None, None, None]))  # fmt: skip
    assert packed_throughout.kernels == ("packed",) * N
    assert tuning.dense_above(packed_throughout) == tuning.EVERY_ROW_COUNT
    # packed dropped out (3x behind) where dense was still timed: dense from there
    dropped = tuning.choose("s", 1, times([1, 30, None, None, None, None],
                                          [2, 5, 4, None, None, None]))  # fmt: skip
    assert dropped.kernels == ("packed",) + ("dense",) * (N - 1)


def test_the_tiles_from_the_first_bucket_they_win_and_their_start_where_the_costs_cross():
    """Dot products 10 us at 8 rows, 34 at 32; tiles 17 and 22: the lines cross at 8 + 24 * 7 /
    19 = 16.8 rows, so the tiles serve 17 rows and more, the packed kernel to 128 (dense past)."""
    timed = {
        "packed": [2, 10, 34, 130, None, None],
        "tiles": [15, 17, 22, 40, None, None],
        "dense": [50, 60, 70, 80, 100, None],
    }
    choice = tuning.choose("s", 1, timed)
    assert choice.kernels == ("packed", "packed", "tiles", "tiles", "dense", "dense")
    assert tuning.tiles_from(choice) == 17
    assert tuning.dense_above(choice) == 128
    # the tiles faster from one row: every call; never faster: never
    timed["tiles"] = [1, 1, 1, 1, None, None]
    assert tuning.tiles_from(tuning.choose("s", 1, timed)) == 1
    timed["tiles"] = [30, 30, 40, 140, None, None]
    assert tuning.tiles_from(tuning.choose("s", 1, timed)) == 0


@pytest.mark.skipif(not blocked_kernel_available(), reason="needs the blocked int4 kernel")
def test_a_model_is_timed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """Two layers of one shape and one of another: two shapes timed, every layer's threshold set
    from its shape's choice; a second plan reads the cache (timing nothing) and sets the same
    thresholds."""
    gen = torch.Generator().manual_seed(0)

    def layer(out_features, in_features):
        weight = torch.randn(out_features, in_features, generator=gen)
        return Int4Linear.from_float(weight, None, torch.bfloat16)

    model = nn.Sequential(layer(64, 128), layer(64, 128), layer(128, 64))
    plan = tuning.plan_quantized_kernels(model, tmp_path)
    assert len(plan) == 2 and {c.num_layers for c in plan.values()} == {1, 2}
    for module in model:
        choice = plan[tuning.shape_key(module)]
        assert module.dense_above == tuning.dense_above(choice)
        assert module.tiles_from == tuning.tiles_from(choice)
        assert choice.times_us["packed"][0] is not None and choice.times_us["dense"][0] is not None
        assert ("tiles" in choice.times_us) == tiles_available()
    thresholds = [(module.dense_above, module.tiles_from) for module in model]
    for module in model:
        module.dense_above, module.tiles_from = -1, -1
    monkeypatch.setattr(tuning, "time_layer", lambda *args: pytest.fail("timed again"))
    assert tuning.plan_quantized_kernels(model, tmp_path) == plan
    assert [(module.dense_above, module.tiles_from) for module in model] == thresholds


def test_float32_layers_are_not_timed(tmp_path):
    weight = torch.randn(32, 64)
    model = nn.Sequential(Int4Linear.from_float(weight, None, torch.float32))
    assert tuning.plan_quantized_kernels(model, tmp_path) == {}


def test_a_layer_too_large_to_time_keeps_its_default_and_is_not_timed_again(tmp_path, monkeypatch):
    weight = torch.randn(64, 128)
    layer = Int4Linear.from_float(weight, None, torch.bfloat16)
    default = layer.dense_above
    monkeypatch.setattr(tuning, "MAX_TIMED_BYTES", 1024)
    model = nn.Sequential(layer)
    plan = tuning.plan_quantized_kernels(model, tmp_path)
    (choice,) = plan.values()
    assert all(t is None for path in choice.times_us.values() for t in path)
    assert layer.dense_above == default
    # cached as untimed: the next start finds it and times nothing
    monkeypatch.setattr(tuning, "time_layer", lambda *args: pytest.fail("timed again"))
    assert tuning.plan_quantized_kernels(model, tmp_path) == plan


def test_untimed_layers_report_their_default():
    choice = tuning.default_choice("s", 1, times([None] * N, [None] * N), 128)
    assert choice.kernels == ("packed",) * 4 + ("dense",) * 2
    assert tuning.dense_above(choice) == 128
