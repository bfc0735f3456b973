"""The multi-LoRA matmuls (kernel_ops/lora.py, kernel_ops/triton_lora.py): the Triton kernels
against the torch twin, in Triton's interpreter on the CPU (conftest sets ``TRITON_INTERPRET=1``
without a GPU) and natively on CUDA under the ``gpu`` mark; the twin against a per-row loop in
float64 (the oracle); ``LoRABatch.from_row_slots``; the layout-contract errors.

Poison: the input rows of base-model rows (slot -1) and the weights of a slot no row uses are
NaN, so reading either shows up as NaN in a result; the output buffer of the expand is a column
slice of a wider buffer whose other columns and whose base-model rows are NaN, and must stay NaN.

Tolerances, per dtype, on results of magnitude up to about 7: the twin rounds the LoRA product,
the bias sum and the output sum each to the dtype, where the kernel accumulates in float32 and
rounds once, so bfloat16 and float16 may differ by units in the last place; float32 by the
summation order of up to 1536 products. Measured in the interpreter over CASES: kernel vs twin at
most one unit (bfloat16 0.031, float16 0.0039 on values in [4, 8); float32 1.1e-6), twin vs the
float64 oracle 0.047 (bfloat16), 0.0047 (float16), 1.5e-6 (float32).
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from llmrpc.kernels import triton_lora
from llmrpc.kernels.lora import LoRABatch, lora_expand, lora_expand_torch, lora_shrink

TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}
DTYPES = [pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in TOLERANCE]
NAN = float("nan")
NUM_SLOTS = 4  # slot 3 is never used: its weights are NaN
# The slot of each row of the flat batch, as the model runner builds it.
LAYOUTS = {
    # adapters and the base model mixed; slot 0 in two separate segments
    "mixed": [0, 0, -1, 2, 2, 2, 0, -1, 1],
    # decode: a segment per row, repeated slots apart, base-model rows between
    "decode": [1, 0, 2, -1, 0, 1, -1, 2, 0],
    # one prefill chunk longer than a 64-row tile, between base and decode rows
    "prefill": [-1, -1, *[1] * 70, 0, 2],
    # the whole batch under one adapter
    "one-slot": [2] * 6,
}
# (layout, in_features, out_features, R, with bias): ranks 8-64 and the R of q/k/v stacked
# (3 * rank, not a power of two), features not multiples of any tile
CASES = [
    pytest.param(("mixed", 64, 96, 8, False), id="mixed-64x96-r8"),
    pytest.param(("decode", 576, 192, 48, True), id="decode-576x192-r48-bias"),
    pytest.param(("prefill", 96, 1536, 16, True), id="prefill-96x1536-r16-bias"),
    pytest.param(("one-slot", 1536, 64, 64, True), id="one-slot-1536x64-r64-bias"),
    pytest.param(("mixed", 96, 576, 192, True), id="mixed-96x576-r192-bias"),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def make_inputs(layout, in_features, out_features, rank, with_bias, dtype, device):
    """(row_slots, x, a_stacked, b_stacked, bias, wide output buffer, out: a column slice of
    it), poisoned as the module docstring says, in ``dtype`` on ``device``."""
    row_slots = LAYOUTS[layout]
    base_rows = torch.tensor([slot == -1 for slot in row_slots])
    num_tokens = len(row_slots)
    x = randn(num_tokens, in_features, seed=1)
    x[base_rows] = NAN
    # weights scaled so that h and the LoRA product are about N(0, 1), as trained adapters' are
    a_stacked = randn(NUM_SLOTS, rank, in_features, seed=2, scale=in_features**-0.5)
    b_stacked = randn(NUM_SLOTS, out_features, rank, seed=3, scale=rank**-0.5)
    bias = randn(NUM_SLOTS, out_features, seed=4) if with_bias else None
    for weights in (a_stacked, b_stacked, bias):
        if weights is not None:
            weights[NUM_SLOTS - 1] = NAN
    wide = torch.full((num_tokens, out_features + 24), NAN)
    wide[~base_rows, 8 : 8 + out_features] = randn(num_tokens, out_features, seed=5)[~base_rows]
    tensors = [t if t is None else t.to(device, dtype) for t in (x, a_stacked, b_stacked, bias)]
    wide = wide.to(device, dtype)
    return row_slots, *tensors, wide, wide[:, 8 : 8 + out_features]


def assert_untouched_poison(wide: torch.Tensor, out_features: int, row_slots) -> None:
    base_rows = torch.tensor([slot == -1 for slot in row_slots], device=wide.device)
    assert wide[:, :8].isnan().all() and wide[:, 8 + out_features :].isnan().all()
    assert wide[base_rows].isnan().all(), "a base-model row of out was written"
    assert not wide[~base_rows, 8 : 8 + out_features].isnan().any(), "a LoRA row got NaN"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_twin(device, dtype, case):
    layout, in_features, out_features, rank, with_bias = case
    row_slots, x, a, b, bias, wide, out = make_inputs(*case, dtype, device)
    batch = LoRABatch.from_row_slots(row_slots, device, backend="triton")
    twin = LoRABatch.from_row_slots(row_slots, device, backend="torch")

    h = lora_shrink(x, a, batch)
    h_twin = lora_shrink(x, a, twin)
    base_rows = torch.tensor([slot == -1 for slot in row_slots], device=device)
    assert torch.equal(h[base_rows], torch.zeros_like(h[base_rows]))
    torch.testing.assert_close(h, h_twin, **TOLERANCE[dtype])

    h_twin[base_rows] = NAN  # the expand must not read base-model rows of h either
    wide_twin = wide.clone()
    out_twin = wide_twin[:, 8 : 8 + out_features]
    lora_expand(h_twin, b, batch, out, bias)
    lora_expand(h_twin, b, twin, out_twin, bias)
    assert_untouched_poison(wide, out_features, row_slots)
    torch.testing.assert_close(wide, wide_twin, equal_nan=True, **TOLERANCE[dtype])


def oracle(row_slots, x, a, b, bias, out):
    """The result of shrink then expand, one row at a time in float64."""
    expected = out.double().clone()
    for row, slot in enumerate(row_slots):
        if slot == -1:
            continue
        h = x[row].double() @ a[slot].double().T
        expected[row] += h @ b[slot].double().T
        if bias is not None:
            expected[row] += bias[slot].double()
    return expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_twin_matches_a_per_row_loop(dtype, case):
    row_slots, x, a, b, bias, wide, out = make_inputs(*case, dtype, torch.device("cpu"))
    expected = oracle(row_slots, x, a, b, bias, out)
    batch = LoRABatch.from_row_slots(row_slots, "cpu")
    lora_expand(lora_shrink(x, a, batch), b, batch, out, bias)
    assert_untouched_poison(wide, case[2], row_slots)
    # h is rounded to the dtype between the two products: one more rounding than the oracle's
    torch.testing.assert_close(out.double(), expected, equal_nan=True, **TOLERANCE[dtype])


def test_from_row_slots_merges_runs_and_lists_rows_per_slot():
    batch = LoRABatch.from_row_slots([0, 0, -1, -1, 2, 0, 0, 0, -1], "cpu", backend="triton")
    assert batch.seg_starts.tolist() == [0, 2, 4, 5, 8, 9]
    assert batch.seg_slots.tolist() == [0, -1, 2, 0, -1]
    assert batch.seg_starts.dtype == batch.seg_slots.dtype == torch.int32
    assert batch.max_seg_len == 3  # segments with a slot only: the -1 run of 2 costs no tiles
    assert [(slot, rows.tolist()) for slot, rows in batch.slot_rows] == [
        (0, [0, 1, 5, 6, 7]),
        (2, [4]),
    ]
    assert all(rows.dtype == torch.int64 for _, rows in batch.slot_rows)
    assert batch.backend == "triton"


def test_from_row_slots_without_lora_rows_is_none_and_bad_slots_are_refused():
    assert LoRABatch.from_row_slots([-1, -1, -1], "cpu") is None
    assert LoRABatch.from_row_slots([], "cpu") is None
    with pytest.raises(ValueError, match=r"row_slots\[1\] is -2"):
        LoRABatch.from_row_slots([0, -2], "cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        LoRABatch.from_row_slots([0], "cpu", backend="cuda")


def test_twin_leaves_base_rows_alone_when_out_is_a_slice():
    # the twin's scatter-add into a column slice (the engine hands q, k and v slices of qkv)
    row_slots, x, a, b, bias, wide, out = make_inputs(*CASES[1].values[0], torch.float32, "cpu")
    batch = LoRABatch.from_row_slots(row_slots, "cpu")
    lora_expand_torch(lora_shrink(x, a, batch), b, batch, out, bias)
    assert_untouched_poison(wide, CASES[1].values[0][2], row_slots)


def _contract_inputs(device):
    x = randn(3, 64, seed=0).to(device)
    a = randn(2, 8, 64, seed=1).to(device)
    b = randn(2, 32, 8, seed=2).to(device)
    h = randn(3, 8, seed=3).to(device)
    out = torch.zeros(3, 32, device=device)
    batch = LoRABatch.from_row_slots([0, -1, 1], device, backend="triton")
    return x, a, b, h, out, batch


def test_layout_contract_errors_name_the_argument(device):
    x, a, b, h, out, batch = _contract_inputs(device)
    shrink_cases = [
        ((x[0], a, batch), "^x must be 2-D"),
        ((x.double(), a.double(), batch), "^x is torch.float64"),
        ((x.t().contiguous().t(), a, batch), "^x must be contiguous in its last"),
        ((x, a[:, :, :32], batch), r"^a_stacked must be \[S, R, in_features\]"),
        ((x, a.half(), batch), "^a_stacked is torch.float16, expected torch.float32"),
        ((x, randn(2, 257, 64, seed=0).to(device), batch), "^a_stacked has rank 257"),
        ((x, a.to("meta"), batch), "^a_stacked is on meta"),
    ]
    for args, message in shrink_cases:
        with pytest.raises(ValueError, match=message):
            triton_lora.lora_shrink(*args)
    wide = torch.zeros(3, 64, device=device)
    expand_cases = [
        ((h, b, batch, out[:2]), r"^out has shape \(2, 32\), expected \(3, 32\)"),
        ((h, b, batch, out.half()), "^out is torch.float16, h torch.float32"),
        ((h, b, batch, wide[:, ::2]), "^out must be contiguous in its last"),
        ((h, b, batch, wide[:1, :32].expand(3, 32)), "^out's rows must not overlap"),
        ((h, b[:, :, :4], batch, out), r"^b_stacked must be \[S, out_features, R\]"),
        ((h, b, batch, out, torch.zeros(3, 32, device=device)), r"^bias must be \[S, out"),
        ((h, b, batch, out, torch.zeros(2, 32, device=device).half()), "^bias is torch.float16"),
    ]
    for args, message in expand_cases:
        with pytest.raises(ValueError, match=message):
            triton_lora.lora_expand(*args)


def test_batch_contract_errors(device):
    x, a, _, _, _, batch = _contract_inputs(device)
    bad = [
        (dict(seg_starts=batch.seg_starts.long()), "^seg_starts is torch.int64, expected"),
        (dict(seg_slots=batch.seg_slots[:2]), r"^seg_starts has shape \(4,\), expected \(3,\)"),
        (dict(seg_starts=batch.seg_starts.to("meta")), "^seg_starts is on meta"),
        (dict(max_seg_len=0), "^max_seg_len must be at least 1"),
    ]
    for changes, message in bad:
        with pytest.raises(ValueError, match=message):
            triton_lora.lora_shrink(x, a, LoRABatch(**{**vars(batch), **changes}))


def test_padded_batch_gives_the_same_result(device):
    # A batch padded to a fixed grid (as a CUDA graph captures it): empty segments after the
    # end and a max_seg_len above the longest segment change nothing.
    row_slots, x, a, b, bias, wide, out = make_inputs(*CASES[0].values[0], torch.float32, device)
    batch = LoRABatch.from_row_slots(row_slots, device, backend="triton")
    num_tokens = len(row_slots)
    ends = torch.full((3,), num_tokens, dtype=torch.int32, device=device)
    padded = LoRABatch(
        seg_starts=torch.cat([batch.seg_starts, ends]),
        seg_slots=torch.cat([batch.seg_slots, torch.tensor([1, -1, 0], device=device).int()]),
        max_seg_len=40,
        slot_rows=batch.slot_rows,
        backend="triton",
    )
    h = lora_shrink(x, a, batch)
    assert torch.equal(lora_shrink(x, a, padded), h)
    wide_padded = wide.clone()
    lora_expand(h, b, batch, out, bias)
    lora_expand(h, b, padded, wide_padded[:, 8 : 8 + out.shape[1]], bias)
    assert torch.equal(wide_padded.nan_to_num(), wide.nan_to_num())
