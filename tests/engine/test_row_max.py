"""The sampler's row maximum equals torch.max(dim=-1): values and the first index of ties."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrpc.engine.sample.sampler import row_max

SPECIAL = [math.inf, -math.inf, 0.0, 1.0, -1.0]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 700),
    seed=st.integers(0, 2**16),
    chunk=st.sampled_from([1, 7, 64, 256]),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=20),
)
def test_matches_torch_max(rows, width, seed, chunk, specials):
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values, so ties are common; specials put +-inf and repeats anywhere.
    values = torch.randint(-3, 4, (rows, width), generator=generator).float()
    for position, value in specials:
        values.view(-1)[position % values.numel()] = value
    best, index = row_max(values, chunk)
    expected = values.max(dim=-1)
    assert torch.equal(best, expected.values)
    assert torch.equal(index, expected.indices)


def test_nan_row_has_a_nan_maximum_and_others_are_untouched():
    values = torch.tensor([[1.0, float("nan"), 3.0], [5.0, 2.0, 5.0]])
    best, index = row_max(values, chunk=2)
    assert math.isnan(best[0]) and best[1] == 5.0 and index[1] == 0


def test_no_rows():
    best, index = row_max(torch.empty(0, 49152))
    assert best.shape == index.shape == (0,) and index.dtype == torch.long


def test_no_rows_stay_on_the_logits_device():
    # A step of non-final prompt chunks has no rows: the result must be on the logits' device
    # (it was always on the CPU, and torch.where then mixed devices on CUDA).
    best, index = row_max(torch.empty(0, 49152, device="meta"))
    assert best.device == index.device == torch.device("meta")
