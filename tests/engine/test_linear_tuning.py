"""Linear kernels chosen by measurement (kernel_ops/linear_tuning.py): the AMX tile kernel over the
blocked layout, the per-bucket dispatch inside the C++ op, the choice rules, the cache, and every
candidate forced through the same model within its tolerance."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from engine_utils import bf16_linear_case
from torch import nn

from llmrpc.kernels import cpu_ops, linear_tuning
from llmrpc.kernels.linear import BlockedLinear, PackedLinear, RowsEmbedding, pack_linear_layers
from llmrpc.kernels.linear_tuning import ROW_BUCKETS, choose, row_bucket

BLOCKED = cpu_ops.load() and torch.ops.llmrpc_cpu.bf16_linear_supported()
AMX = BLOCKED and torch.ops.llmrpc_cpu.bf16_amx_supported()
FMA = cpu_ops.load() and torch.ops.llmrpc_cpu.bf16_fma_supported()
# each one-row kernel (csrc/bf16_linear.cpp's id) with the kernel of its instruction set
ONE_ROW = [
    pytest.param(2, 0, id="gemv", marks=pytest.mark.skipif(not BLOCKED, reason="no AVX512-BF16")),
    pytest.param(4, 3, id="gemv-avx2", marks=pytest.mark.skipif(not FMA, reason="no AVX2 and FMA")),
]
needs_amx = pytest.mark.skipif(not AMX, reason="the tile kernel needs a CPU with AMX-BF16")
EDGES = [1, 2, 8, 9, 32, 33, 128, 129, 1024, 1025]  # each bucket's ends


def _linear(out_features: int, in_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    return bf16_linear_case(out_features, in_features, 0, bias, seed)[0]


def _rows(rows: int, in_features: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 70])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(16, 32), (48, 64), (208, 576), (32, 2112)]
)
def test_the_tile_kernel_gives_the_exact_products_rounded(out_features, in_features, rows):
    """As the dot-product kernel's bound: bfloat16 rounding of the output plus float32 rounding
    of the running sum; odd block counts, row tails of each tile shape, and inputs in one pass
    (up to 2048) or in passes whose sums are kept between them (2112: 2048 + 64)."""
    linear, x = _linear(out_features, in_features), _rows(rows, in_features)
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    magnitude = x.double().abs() @ linear.weight.double().abs().T
    bound = exact.abs() * 2.0**-8 + magnitude * in_features * 2.0**-23 + 1e-30
    layer = BlockedLinear(linear)
    layer.kernel_by_bucket = [1] * len(ROW_BUCKETS)
    error = (layer(x).double() - exact).abs()
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max():.2f}"


@needs_amx
def test_a_rows_tile_output_is_the_same_alone_and_in_any_batch():
    layer = BlockedLinear(_linear(80, 96))
    layer.kernel_by_bucket = [1] * len(ROW_BUCKETS)
    x = _rows(70, 96)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
    for rows in (2, 15, 16, 17, 32, 33, 48, 70):
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"


@pytest.mark.skipif(not BLOCKED, reason="the blocked kernels need AVX512-BF16")
def test_many_rows_split_over_threads_give_each_row_its_bits_alone():
    """From 192 rows two threads split the dot-product kernel's rows, not its blocks (an uneven
    split here: 5 blocks): every row still has the output it has alone."""
    layer = BlockedLinear(_linear(80, 96))
    layer.kernel_by_bucket = [0] * len(ROW_BUCKETS)
    x = _rows(251, 96)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(251)])
    cpu_ops.set_kernel_threads(2)
    try:
        for rows in (191, 192, 251):
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
    finally:
        cpu_ops.set_kernel_threads(0)


@needs_amx
def test_each_call_takes_its_buckets_kernel():
    """The C++ op's buckets are Python's: at each bucket's ends the output is the one of the
    kernel named for that bucket (the two kernels differ in some last bits, which shows it)."""
    layer = BlockedLinear(_linear(4096, 576))
    op = torch.ops.llmrpc_cpu.bf16_linear
    by_bucket = [0, 1, 0, 1, 0, 1]
    differed = 0
    for rows in EDGES:
        x = _rows(rows, 576, seed=rows)
        chosen = by_bucket[row_bucket(rows)]
        out = op(x, layer.weight_blocks, layer.bias, by_bucket)
        assert torch.equal(out, op(x, layer.weight_blocks, layer.bias, [chosen] * 6)), rows
        differed += not torch.equal(out, op(x, layer.weight_blocks, layer.bias, [1 - chosen] * 6))
    assert differed >= 5


@pytest.mark.parametrize(("one_row", "sibling"), ONE_ROW)
@pytest.mark.parametrize(
    ("out_features", "in_features", "bias"),
    [(16, 34, True), (48, 64, False), (208, 576, True), (64, 1542, True), (32, 2112, False)],
)
def test_the_one_row_kernel_gives_the_exact_products_rounded(
    out_features, in_features, bias, one_row, sibling
):
    """The dot-product kernel's bound, over pair counts with every tail past the four chains
    (17, 32, 288, 771, 1056 pairs)."""
    linear, x = _linear(out_features, in_features, bias), _rows(1, in_features)
    exact = x.double() @ linear.weight.double().T
    if bias:
        exact += linear.bias.double()
    magnitude = x.double().abs() @ linear.weight.double().abs().T
    bound = exact.abs() * 2.0**-8 + magnitude * in_features * 2.0**-23 + 1e-30
    layer = BlockedLinear(linear)
    layer.kernel_by_bucket = [one_row] + [sibling] * 5
    error = (layer(x).double() - exact).abs()
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max():.2f}"
    two = _rows(2, in_features)
    assert layer(two).shape == (2, out_features)  # past one row the list's next kernel serves
    layer.kernel_by_bucket = [one_row] * 6
    with pytest.raises(RuntimeError, match="the one-row kernel takes one row, not 2"):
        layer(two)


@pytest.mark.parametrize("kernel", [k for k in linear_tuning.BLOCKED_KERNEL_IDS])
def test_a_call_of_no_rows_gives_no_rows_whichever_kernel_its_bucket_names(kernel):
    """A step that only pools computes logits for no row: the head is called with zero rows,
    which fall in the first bucket (the one-row kernel's). Such a call stopped the engine."""
    fma_kernels = ("blocked-avx2", "blocked-gemv-avx2", "blocked-avx2-f32")
    built = AMX if kernel == "blocked-amx" else FMA if kernel in fma_kernels else BLOCKED
    if not built:
        pytest.skip(f"this build or CPU has no {kernel} kernel")
    layer = BlockedLinear(_linear(48, 64))
    layer.kernel_by_bucket = [linear_tuning.BLOCKED_KERNEL_IDS[kernel]] * len(ROW_BUCKETS)
    assert layer(_rows(0, 64)).shape == (0, 48)


def test_the_one_row_kernel_serves_one_row_and_never_a_uniform_layer():
    times = {**TIMES, "blocked-gemv": [7.0, None, None, None, None, None]}
    choice = choose("bfloat16 576x576", 60, times, tied=False, uniform=False)
    assert choice.kernels == ("blocked-gemv",) + ("blocked-amx",) * 5
    uniform = choose("bfloat16 576x576", 60, times, tied=False, uniform=True)
    assert "blocked-gemv" not in uniform.kernels and len(set(uniform.kernels)) == 1
    only = choose("s", 1, {"blocked-gemv": times["blocked-gemv"]}, tied=False, uniform=False)
    assert only.kernels == ("blocked-gemv",) + ("blocked-avx512bf16",) * 5
    avx2 = {
        "blocked-avx2": [9.0, 20.0, 40.0, 80.0, 300.0, None],
        "blocked-gemv-avx2": [7.0] + [None] * 5,
        "onednn": [8.0, 30.0, 50.0, 90.0, 320.0, None],
    }
    choice = choose("s", 1, avx2, tied=False, uniform=False)
    assert choice.kernels == ("blocked-gemv-avx2",) + ("blocked-avx2",) * 5
    only = choose("s", 1, {"blocked-gemv-avx2": [7.0] + [None] * 5}, tied=False, uniform=False)
    assert only.kernels == ("blocked-gemv-avx2",) + ("blocked-avx2",) * 5


def test_past_an_untimed_one_row_bucket_the_first_many_row_candidate_serves():
    """A budget cut after one row: on a CPU with AVX512-BF16 the AVX2 one-row kernel may win that
    row, and the rows past it take the dot products, not the AVX2 kernel nobody timed (which a
    clean-clone run gave, failing test_the_measurement_stops_at_its_budget)."""
    times = {
        "blocked-avx512bf16": [10.0] + [None] * 5,
        "blocked-gemv": [8.0] + [None] * 5,
        "blocked-gemv-avx2": [7.0] + [None] * 5,
    }
    choice = choose("s", 1, times, tied=False, uniform=False)
    assert choice.kernels == ("blocked-gemv-avx2",) + ("blocked-avx512bf16",) * 5


def test_a_uniform_layer_may_mix_kernels_that_sum_alike_and_no_others():
    """The AVX2 kernel and its float32-segment form give the same bits (test_bf16_linear.py), so a
    batch-invariant layer takes the faster of the two in each bucket; kernels that sum otherwise
    still never mix."""
    avx2 = {
        "blocked-avx2": [9.0, 20.0, 40.0, 80.0, 300.0, None],
        "blocked-avx2-f32": [20.0, 24.0, 34.0, 68.0, 250.0, None],
        "blocked-gemv-avx2": [7.0] + [None] * 5,
    }
    uniform = choose("s", 1, avx2, tied=False, uniform=True)
    assert uniform.kernels == ("blocked-avx2",) * 2 + ("blocked-avx2-f32",) * 4
    apart = choose(
        "s", 1, {**TIMES, "blocked-avx2": avx2["blocked-avx2"]}, tied=False, uniform=True
    )
    assert len(set(apart.kernels)) == 1


@pytest.mark.parametrize(("one_row", "sibling"), ONE_ROW)
def test_the_one_row_kernel_is_timed_at_one_row_only(one_row, sibling):
    names = {i: name for name, i in linear_tuning.BLOCKED_KERNEL_IDS.items()}
    layers = [nn.Linear(64, 128).bfloat16() for _ in range(2)]
    kernels = [names[sibling], names[one_row]]
    times, short = linear_tuning.time_shape(layers, kernels, deadline=float("inf"))
    assert not short
    assert times[names[one_row]][0] > 0 and times[names[one_row]][1:] == [None] * 5
    assert all(t is not None for t in times[names[sibling]][:5])


@pytest.mark.skipif(not BLOCKED, reason="the blocked kernels need AVX512-BF16")
def test_the_op_refuses_a_bad_kernel_list():
    layer = BlockedLinear(_linear(16, 64))
    op, x = torch.ops.llmrpc_cpu.bf16_linear, _rows(3, 64)
    with pytest.raises(RuntimeError, match="takes 6 kernels"):
        op(x, layer.weight_blocks, layer.bias, [0, 1])
    with pytest.raises(RuntimeError, match="none of 0"):
        op(x, layer.weight_blocks, layer.bias, [6] * 6)
    for one_row in (2, 4):
        with pytest.raises(RuntimeError, match="takes one row, not 3"):
            op(x, layer.weight_blocks, layer.bias, [one_row] * 6)
    if AMX:  # 64 inputs pass; 48 are not a multiple of 32
        layer = BlockedLinear(_linear(16, 48))
        with pytest.raises(RuntimeError, match="multiples of 32"):
            op(_rows(3, 48), layer.weight_blocks, layer.bias, [1] * 6)


def test_row_buckets():
    assert [row_bucket(r) for r in EDGES] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
    assert [linear_tuning.bucket_name(i) for i in range(6)] == [
        "1", "2-8", "9-32", "33-128", "129-1024", "1025+",
    ]  # fmt: skip


# --- the choice ------------------------------------------------------------------------------

TIMES = {  # microseconds per layer, per bucket
    "blocked-avx512bf16": [10.0, 20, 80, 300, None, None],
    "blocked-amx": [11.0, 12, 14.5, 36, 125, 520],
    "onednn": [14.0, 13, 14, 35, 120, 500],
}


def test_a_layout_by_its_losses_and_each_bucket_its_fastest_kernel():
    choice = choose("bfloat16 576x576", 60, TIMES, tied=False, uniform=False)
    # blocked loses log(14.5/14) + log(36/35) + ... = 0.14 to the best, oneDNN log(14/10) + ...
    assert choice.layout == "blocked"
    assert choice.kernels == ("blocked-avx512bf16",) + ("blocked-amx",) * 5
    slower = {**TIMES, "blocked-amx": [11.0, 20, 28, 80, 300, 1200]}
    choice = choose("bfloat16 576x576", 60, slower, tied=False, uniform=False)
    assert choice.layout == "onednn" and set(choice.kernels) == {"onednn"}
    # a tied layer keeps the layout that serves its embedding's rows; so does batch invariance,
    # with one kernel for every row count
    assert choose("s", 1, slower, tied=True, uniform=False).layout == "blocked"
    uniform = choose("s", 1, slower, tied=False, uniform=True)
    assert uniform.layout == "blocked" and uniform.kernels == ("blocked-amx",) * 6


def test_an_untimed_bucket_takes_the_last_timed_choice():
    times = {
        "onednn": [5.0, 5, 6, None, None, None],
        "blocked-avx512bf16": [4.0, 6, 7, None, None, None],
    }
    choice = choose("bfloat16 64x64", 2, times, tied=False, uniform=False)
    assert choice.layout == "onednn"  # log(5/4) lost at 1 row, log(6/5)+log(7/6) won after
    assert choice.kernels == ("onednn",) * 6
    assert "33-128 rows onednn (untimed)" in choice.describe()


# --- measuring a model -----------------------------------------------------------------------


class _Model(nn.Module):
    """Two layer shapes (one repeated) and a head tied to the embedding."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.embed = nn.Embedding(96, 64).to(dtype)
        self.up = nn.ModuleList(nn.Linear(64, 128).to(dtype) for _ in range(2))
        self.down = nn.Linear(128, 64, bias=False).to(dtype)
        self.head = nn.Linear(64, 96, bias=False).to(dtype)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for up in self.up:
            hidden = hidden + self.down(torch.relu(up(hidden)))
        return self.head(hidden)


def _reference(dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(40) % 96
    model = _Model(dtype).double()
    with torch.no_grad():
        return ids, model(ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", linear_tuning.KERNELS)
def test_every_candidate_forced_gives_the_models_output_within_its_tolerance(
    dtype, kernel, monkeypatch
):
    model = _Model(dtype)
    names = linear_tuning.candidates(model.down)
    if kernel not in names:
        pytest.skip(f"{kernel} cannot run {dtype} here")
    monkeypatch.setattr(linear_tuning, "candidates", lambda linear: [kernel])  # the only one
    plan = linear_tuning.plan_linear_kernels(model, None)
    # a one-row kernel serves one row; calls of more take its instruction set's kernel
    rest = linear_tuning.ONE_ROW_KERNELS.get(kernel, kernel)
    assert {choice.kernels for choice in plan.values()} == {(kernel,) + (rest,) * 5}
    pack_linear_layers(model, linear_tuning.layouts(plan))
    expected_type = {"blocked": BlockedLinear, "onednn": PackedLinear}
    assert type(model.down) is expected_type[linear_tuning.LAYOUT[kernel]]
    if kernel.startswith("blocked"):
        assert type(model.embed) is RowsEmbedding  # the tied head's weight, held once
    ids, exact = _reference(dtype)
    with torch.inference_mode():
        out = model(ids).double()
    # bfloat16: three roundings of activations of order 1 in a residual stack; float32: sums
    tolerance = 0.15 if dtype == torch.bfloat16 else 1e-4
    assert (out - exact).abs().max().item() < tolerance * max(1.0, exact.abs().max().item())


@pytest.mark.skipif(not BLOCKED, reason="one candidate (oneDNN) only: nothing is timed")
def test_a_second_start_reads_the_cache_and_another_machine_does_not(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="llmrpc.kernels.linear_tuning"):
        first = linear_tuning.plan_linear_kernels(_Model(torch.bfloat16), tmp_path)
    assert any("timed the linear kernels for 3 layer shapes" in r.message for r in caplog.records)
    (saved,) = tmp_path.glob("linear-*.json")
    data = json.loads(saved.read_text())
    assert data["key"]["threads"] == str(torch.get_num_threads())
    assert set(data["shapes"]) == {"bfloat16 64x128 bias", "bfloat16 128x64", "bfloat16 64x96"}

    def no_timing(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(linear_tuning, "time_shape", no_timing)
    again = linear_tuning.plan_linear_kernels(_Model(torch.bfloat16), tmp_path)
    assert again == first
    key = {**linear_tuning.machine_key(), "cpu": "another CPU"}
    monkeypatch.setattr(linear_tuning, "machine_key", lambda: key)
    with pytest.raises(AssertionError, match="timed again"):
        linear_tuning.plan_linear_kernels(_Model(torch.bfloat16), tmp_path)


def test_the_cache_is_keyed_by_onednns_instruction_set_cap(monkeypatch, tmp_path):
    """Under ONEDNN_MAX_CPU_ISA oneDNN runs other code (no AMX, no bfloat16): a timing taken
    without the cap must not be read back under it."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    free = linear_tuning.machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    capped = linear_tuning.machine_key()
    assert capped["onednn_isa"] == "AVX512_CORE_BF16" and free["onednn_isa"] == ""
    assert linear_tuning.cache_file(tmp_path, capped) != linear_tuning.cache_file(tmp_path, free)


@pytest.mark.skipif(not BLOCKED, reason="the blocked kernels need AVX512-BF16")
def test_the_cache_is_keyed_by_the_kernels_build_before_anything_loaded_them(monkeypatch):
    """The engine plans its kernels before it loads the C++ op: the key must still name the
    build, or measurements of old kernels would be read back after the sources change."""
    monkeypatch.setattr(cpu_ops, "_state", {})  # as in a new engine process
    assert linear_tuning.machine_key()["build"] == cpu_ops.build_directory().name


@pytest.mark.skipif(not BLOCKED, reason="one candidate (oneDNN) only: nothing is timed")
def test_the_measurement_stops_at_its_budget(tmp_path, caplog):
    """Past the budget the remaining buckets go untimed and take the last timed choice, and the
    shape is not cached (the next start times it again)."""
    now = [0.0]

    def clock() -> float:
        now[0] += 0.7 * linear_tuning.BUDGET_S  # past the budget at the second look
        return now[0]

    layers = {"bfloat16 64x128 bias": [nn.Linear(64, 128).bfloat16()]}
    with caplog.at_level(logging.INFO, logger="llmrpc.kernels.linear_tuning"):
        plan = linear_tuning.measure(layers, set(), tmp_path, clock=clock)
    (choice,) = plan.values()
    for times in choice.times_us.values():
        assert times[0] is not None and times[1:] == [None] * 5
    first, *rest = choice.kernels  # the untimed buckets take the timed one's choice
    if first in linear_tuning.ONE_ROW_KERNELS:  # which serves one row: the dot products after
        first = "blocked-avx512bf16"
    assert set(rest) == {first}
    assert any("past the 8 s budget" in r.message for r in caplog.records)
    (saved,) = tmp_path.glob("linear-*.json")
    assert json.loads(saved.read_text())["shapes"] == {}
