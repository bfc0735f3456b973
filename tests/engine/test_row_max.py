"""The sampler's row maximum equals torch.max(dim=-1): values and the first index of ties, by
torch's operations (``chunked_row_max``) and by the C++ kernel ``row_max`` takes on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrpc.engine.sample import sampler
from llmrpc.engine.sample.sampler import chunked_row_max, row_max
from llmrpc.kernels import cpu_ops


def _kernel(values, chunk=None):
    assert cpu_ops.load(), "the C++ kernels did not build on this machine (see the log)"
    return torch.ops.llmrpc_cpu.row_max(values)


IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [chunked_row_max, _kernel])

SPECIAL = [math.inf, -math.inf, 0.0, 1.0, -1.0]


@IMPLEMENTATIONS
@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 700),
    seed=st.integers(0, 2**16),
    chunk=st.sampled_from([1, 7, 64, 256]),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=20),
)
def test_matches_torch_max(implementation, rows, width, seed, chunk, specials):
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values, so ties are common; specials put +-inf and repeats anywhere.
    values = torch.randint(-3, 4, (rows, width), generator=generator).float()
    for position, value in specials:
        values.view(-1)[position % values.numel()] = value
    best, index = implementation(values, chunk)
    expected = values.max(dim=-1)
    assert torch.equal(best, expected.values)
    assert torch.equal(index, expected.indices)


@IMPLEMENTATIONS
@pytest.mark.parametrize("width", [3, 21])  # inside one vector, and past two
def test_nan_row_has_a_nan_maximum_and_others_are_untouched(implementation, width):
    values = torch.full((3, width), -1.0)
    values[0, 1] = float("nan")
    values[1, [0, 2]] = 5.0
    values[2, -1] = float("nan")
    best, index = implementation(values, 2)
    assert math.isnan(best[0]) and math.isnan(best[2]) and index[0] >= width
    assert best[1] == 5.0 and index[1] == 0


def test_cpu_rows_take_the_kernel_and_others_the_torch_operations(monkeypatch):
    assert cpu_ops.load()
    calls = []
    kernel = torch.ops.llmrpc_cpu.row_max.default
    monkeypatch.setattr(torch.ops.llmrpc_cpu.row_max, "default",
                        lambda values: calls.append(values.dtype) or kernel(values))  # fmt: skip
    chunked = sampler.chunked_row_max

    def torch_path(values, chunk):
        calls.append("torch")
        return chunked(values, chunk)

    monkeypatch.setattr(sampler, "chunked_row_max", torch_path)
    values = torch.randn(2, 40)
    for case in (values, values.t().contiguous().t(), values.double()):
        best, index = row_max(case)
        assert torch.equal(index, case.max(dim=-1).indices)
    assert calls == [torch.float32, "torch", "torch"]


def test_the_kernel_names_a_bad_input():
    assert cpu_ops.load()
    with pytest.raises(RuntimeError, match="row_max: values must be contiguous"):
        torch.ops.llmrpc_cpu.row_max(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="row_max: rows must hold at least one value"):
        torch.ops.llmrpc_cpu.row_max(torch.zeros(2, 0))


def test_no_rows():
    best, index = row_max(torch.empty(0, 49152))
    assert best.shape == index.shape == (0,) and index.dtype == torch.long


def test_no_rows_stay_on_the_logits_device():
    # A step of non-final prompt chunks has no rows: the result must be on the logits' device
    # (it was always on the CPU, and torch.where then mixed devices on CUDA).
    best, index = row_max(torch.empty(0, 49152, device="meta"))
    assert best.device == index.device == torch.device("meta")
