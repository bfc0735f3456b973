"""The blocked int4 kernel (kernel_ops/csrc/int4_linear.cpp) against the float matmul it stands for
(the weights times the inputs quantized to int8 per 32, as the kernel documents), and the blocked
layout against torch's int4 packing it replaces wherever the kernel is built (AVX2 and FMA: the
AVX2 kernel; AVX512-BF16 and AVX512-VNNI: the AVX-512 one). On an AVX-512 machine the AVX2 kernel
is checked by these tests too, in tests/engine/test_cpu_kernels.py's AVX2 build."""

from __future__ import annotations

import pytest
import torch

from llmrpc.engine.quantization import layers
from llmrpc.engine.quantization.layers import (
    GROUP_SIZE,
    Int4Linear,
    Q8BlockLinear,
    Q8Linear,
    blocked_kernel_available,
)

pytestmark = pytest.mark.skipif(
    not blocked_kernel_available(),
    reason="the int4 kernel needs a CPU with AVX2 and FMA",
)


def _case(out_features: int, in_features: int, rows: int, seed: int = 0):
    """Random codes, scales, zeros and inputs (no zeros among the inputs)."""
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // GROUP_SIZE
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_features, groups, generator=gen) * 0.02 + 1e-3).bfloat16()
    zeros = (torch.randn(out_features, groups, generator=gen) * 0.02).bfloat16()
    x = torch.randn(rows, in_features, generator=gen)
    x = torch.where(x.abs() < 1e-3, 1.0, x).bfloat16()
    return codes, scales, zeros, x


def _weight(codes, scales, zeros) -> torch.Tensor:
    """The float32 weight the codes stand for (exact: (u - 8) * scale, + zero rounded once)."""
    grouped = codes.view(codes.shape[0], -1, GROUP_SIZE).float() - 8
    weight = grouped * scales.float()[..., None] + zeros.float()[..., None]
    return weight.view_as(codes.float())


def _quantized_inputs(x: torch.Tensor) -> torch.Tensor:
    """The inputs as the kernel multiplies them, written out from its documented formula: per row
    and group of 32, ``d = max|x| / 127`` and ``q = round(x * (1 / d))`` (ties to even), in
    float32; returned as ``q * d`` in float64 (exact)."""
    groups = x.float().view(x.shape[0], -1, GROUP_SIZE)
    d = groups.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse)
    return (q.double() * d.double()).view(x.shape)


def _check_close(y: torch.Tensor, x, weight: torch.Tensor, scales, offset: int) -> None:
    """The product of the quantized inputs and ``weight``, within the bfloat16 rounding of the
    output plus float32 rounding of the group sums: the kernel's integer dot products are exact,
    and it adds ``scale * d * dot + (zero - offset * scale) * d * sum(q)`` per group, terms up to
    ``(offset + 16) * scale`` times the inputs. A wrong code, scale, zero, input pairing or input
    quantization is off by about |x| |w| (far more)."""
    quantized = _quantized_inputs(x)
    exact = quantized @ weight.double().T
    per_input = scales.double().repeat_interleave(GROUP_SIZE, dim=1)
    terms = (offset + 16) * per_input + weight.double().abs()
    bound = 2**-8 * exact.abs() + 2**-18 * (quantized.abs() @ terms.T)
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    error = (y.double() - exact).abs()
    assert (error <= bound).all(), (error - bound).max()


def test_quantizing_the_inputs_costs_under_1_percent_of_the_absolute_products():
    """What the kernel's input quantization costs against the unquantized product: each output
    within 1% of its sum of |x| |w| (the int8 steps are 1/254 of a group's largest input). That
    it quantizes exactly as documented is what test_kernel_is_the_float_matmul_of_the_codes
    checks."""
    codes, scales, zeros, x = _case(64, 64, 5)
    layer = Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16)
    weight = _weight(codes, scales, zeros).double()
    unquantized = x.double() @ weight.T
    y = layer.packed_matmul(x).double()
    assert ((y - unquantized).abs() <= 0.01 * (x.double().abs() @ weight.abs().T)).all()


@pytest.mark.parametrize(
    "out_features, in_features", [(16, 32), (48, 96), (960, 576), (576, 1536), (208, 64)]
)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17, 33])
def test_kernel_is_the_float_matmul_of_the_codes(out_features, in_features, rows):
    codes, scales, zeros, x = _case(out_features, in_features, rows, seed=rows)
    layer = Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16)
    assert layer.blocked
    _check_close(layer.packed_matmul(x), x, _weight(codes, scales, zeros), scales, offset=8)


def test_a_row_gets_the_same_bits_alone_as_in_any_batch():
    codes, scales, zeros, x = _case(96, 192, 37)
    layer = Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16)
    batch = layer.packed_matmul(x)
    for row in range(x.shape[0]):
        assert torch.equal(layer.packed_matmul(x[row : row + 1]), batch[row : row + 1]), row
    assert torch.equal(layer.packed_matmul(x[5:14]), batch[5:14])


def test_blocked_layout_unpacks_to_the_codes_and_matches_torch_packing(monkeypatch):
    codes, scales, zeros, x = _case(208, 96, 4)
    blocked = Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16)
    monkeypatch.setattr(layers, "blocked_kernel_available", lambda dtype=None: False)
    torch_packed = Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16)
    assert blocked.blocked and not torch_packed.blocked
    assert blocked.qweight.shape == (13, 3, 8, 32) and blocked.scales_and_zeros.shape == (
        13,
        3,
        2,
        16,
    )
    assert torch.equal(blocked.codes(), codes)
    assert torch.equal(blocked.dequantize(torch.float32), _weight(codes, scales, zeros))
    assert torch.equal(blocked.dequantize(torch.float32), torch_packed.dequantize(torch.float32))
    ids = torch.tensor([0, 207, 15, 16, 100, 15])
    assert torch.equal(blocked._row_codes(ids), codes[ids])
    assert torch.equal(blocked.rows(ids), torch_packed.rows(ids))
    # the same memory: half a byte a weight, a bfloat16 scale and zero per group
    assert layers.packed_bytes(blocked) == 208 * 96 // 2 + 208 * 3 * 4
    # torch's kernel multiplies the same weights by the bfloat16 inputs themselves
    torch.testing.assert_close(
        torch_packed.packed_matmul(x).double(),
        x.double() @ _weight(codes, scales, zeros).double().T,
        atol=0.0,
        rtol=2**-7,
    )


def test_layers_take_the_kernel_up_to_long_prefills_in_bfloat16_only():
    codes, scales, zeros, x = _case(32, 64, 3)
    assert Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16).blocked
    for dtype in (torch.float32, torch.float16):  # their packed kernels are torch's
        assert not Int4Linear.from_codes(codes, scales, zeros, None, dtype).blocked
    layer = Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16)
    assert layer.dense_above == layers.BLOCKED_DENSE_ABOVE >= 512


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, w, s: (x.float(), w, s), "bfloat16"),
        (lambda x, w, s: (x[:, :32].contiguous(), w, s), "features"),
        (lambda x, w, s: (x.t(), w, s), "contiguous"),
        (lambda x, w, s: (x, w.view(w.shape[0], -1), s), "uint8"),
        (lambda x, w, s: (x, w, s.float()), "scales_zeros"),
        (lambda x, w, s: (x, w, s[:1].contiguous()), "scales_zeros"),
    ],
)
def test_bad_layouts_are_named(change, message):
    codes, scales, zeros, x = _case(32, 64, 3)
    layer = Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.llmrpc_cpu.int4_linear(*change(x, layer.qweight, layer.scales_and_zeros))


def _q8_case(out_features: int, in_features: int, rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    d = (torch.rand(out_features, in_features // GROUP_SIZE, generator=gen) * 0.01 + 1e-4).half()
    x = torch.randn(rows, in_features, generator=gen)
    return q, d.float(), torch.where(x.abs() < 1e-3, 1.0, x).bfloat16()


@pytest.mark.parametrize("out_features, in_features", [(16, 32), (48, 96), (576, 576)])
@pytest.mark.parametrize("rows", [1, 2, 9, 33])
def test_q8_kernel_is_the_float_matmul_of_the_blocks(out_features, in_features, rows):
    q, d, x = _q8_case(out_features, in_features, rows, seed=rows)
    layer = Q8Linear.from_blocks(q, d, None, torch.bfloat16)
    scales = d.bfloat16().float()  # held in the model's dtype
    weight = (q.float().view(out_features, -1, GROUP_SIZE) * scales[..., None]).view_as(q.float())
    y = layer.packed_matmul(x)
    _check_close(y, x, weight, scales, offset=128)
    for row in (0, rows - 1):
        assert torch.equal(layer.packed_matmul(x[row : row + 1]), y[row : row + 1])


def test_q8_layout_dequantizes_as_the_two_int4_halves():
    q, d, x = _q8_case(208, 96, 3)
    blocked = Q8Linear.from_blocks(q, d, None, torch.bfloat16)
    halves = Q8BlockLinear.from_blocks(q, d, None, torch.bfloat16)
    weight = q.float() * d.bfloat16().float().repeat_interleave(GROUP_SIZE, dim=1)
    assert torch.equal(blocked.dequantize(torch.float32), weight)
    assert torch.equal(blocked.dequantize(torch.float32), halves.dequantize(torch.float32))
    ids = torch.tensor([0, 207, 15, 16, 100, 15])
    assert torch.equal(blocked.rows(ids), weight[ids].bfloat16())
    assert torch.equal(blocked.rows(ids), halves.rows(ids))
    # one byte a weight and a bfloat16 scale per 32
    assert layers.packed_bytes(blocked) == 208 * 96 + 208 * 3 * 2
    with pytest.raises(RuntimeError, match="q8_linear: scales"):
        torch.ops.llmrpc_cpu.q8_linear(x, blocked.qweight, blocked.scales.float())
    with pytest.raises(RuntimeError, match="q8_linear: weight"):
        torch.ops.llmrpc_cpu.q8_linear(x, blocked.qweight[:, :, :8].contiguous(), blocked.scales)


@pytest.mark.parametrize("layout", ["zeros", "halves"])
@pytest.mark.parametrize("rows", [1, 3, 13])
def test_q8_kernel_with_zeros_or_half_group_scales(layout, rows):
    """Int8 codes with a (d, zero) pair per 32 inputs (GGUF's Q5_1 and Q5_K as written for the
    kernel) or a d per 16 (Q6_K): the kernel against the float matmul of the weights it documents,
    each row the same alone as in the batch; dequantize and rows() give those weights."""
    out_features, in_features = 48, 128
    q, d, x = _q8_case(out_features, in_features, rows, seed=rows)
    gen = torch.Generator().manual_seed(rows + 100)
    if layout == "zeros":
        zeros = (torch.randn(out_features, in_features // GROUP_SIZE, generator=gen) * 0.1).half()
        layer = Q8Linear.from_blocks(q, d, None, torch.bfloat16, zeros=zeros.float())
        per_input = d.bfloat16().float().repeat_interleave(GROUP_SIZE, dim=1)
        offsets = zeros.float().bfloat16().float().repeat_interleave(GROUP_SIZE, dim=1)
        weight = q.float() * per_input + offsets
        scales = d.bfloat16().float()
        # the zero's term is (zero - 128 d) dx sum(q): bounded as a larger offset
        offset = 128 + int((offsets.abs() / per_input).max().ceil())
    else:
        d = (torch.rand(out_features, in_features // 16, generator=gen) * 0.01 + 1e-4).half()
        layer = Q8Linear.from_blocks(q, d.float(), None, torch.bfloat16)
        per_input = d.float().bfloat16().float().repeat_interleave(16, dim=1)
        weight = q.float() * per_input
        # two halves, each offset by 128 d: bounded per 32 by the larger d
        scales = per_input.view(out_features, -1, GROUP_SIZE).amax(dim=-1)
        offset = 128
    assert layer.scales.shape == (out_features // 16, in_features // GROUP_SIZE, 2, 16)
    assert torch.equal(layer.dequantize(torch.float32), weight)
    ids = torch.tensor([0, 47, 16, 5, 16])
    assert torch.equal(layer.rows(ids), weight[ids].bfloat16())
    y = layer.packed_matmul(x)
    _check_close(y, x, weight, scales, offset=offset)
    for row in range(rows):
        assert torch.equal(layer.packed_matmul(x[row : row + 1]), y[row : row + 1])


def test_q8_zeros_flag_needs_pairs_of_scales():
    q, d, x = _q8_case(16, 32, 2)
    layer = Q8Linear.from_blocks(q, d, None, torch.bfloat16)
    with pytest.raises(RuntimeError, match="zeros=True takes scales"):
        torch.ops.llmrpc_cpu.q8_linear(x, layer.qweight, layer.scales, True)


@pytest.mark.skipif(layers.tiles_available(), reason="this build and CPU have the tile path")
def test_tiles_are_refused_by_name_where_the_build_has_none():
    """A call that asks for the tile path where there is none says so, rather than running the
    dot products in its place; one of fewer rows than tiles_from runs them."""
    codes, scales, zeros, x = _case(16, 32, 2)
    layer = Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16)
    with pytest.raises(RuntimeError, match="int4_linear: tiles_from needs AMX-BF16 tiles"):
        layer.packed_matmul(x, tiles_from=2)
    assert torch.equal(layer.packed_matmul(x, tiles_from=3), layer.packed_matmul(x))


def _q8_layer(layout: str, out_features: int, in_features: int, seed: int):
    q, d, _ = _q8_case(out_features, in_features, 1, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    if layout == "zeros":
        zeros = torch.randn(out_features, in_features // GROUP_SIZE, generator=gen) * 0.1
        return Q8Linear.from_blocks(q, d, None, torch.bfloat16, zeros=zeros)
    if layout == "halves":
        halves = torch.rand(out_features, in_features // 16, generator=gen) * 0.01 + 1e-4
        return Q8Linear.from_blocks(q, halves, None, torch.bfloat16)
    return Q8Linear.from_blocks(q, d, None, torch.bfloat16)


@pytest.mark.skipif(not layers.tiles_available(), reason="the tile path needs AMX-BF16")
@pytest.mark.parametrize("kind", ["int4", "q8", "zeros", "halves"])
@pytest.mark.parametrize(
    "out_features, in_features, rows",
    [(16, 32, 1), (208, 96, 17), (48, 2112, 33), (144, 128, 40)],  # 2112: two passes of inputs
)
def test_tile_path_is_the_bfloat16_matmul_of_the_dequantized_weight(
    kind, out_features, in_features, rows
):
    """The tile path (tiles_from) dequantizes each weight to bfloat16 and multiplies the inputs
    unquantized: the float matmul of ``dequantize()``'s bfloat16 weight, within the output's
    bfloat16 rounding and float32 sums; a row alone gets the bits it gets in the batch."""
    if kind == "int4":
        codes, scales, zeros, _ = _case(out_features, in_features, 1, seed=rows)
        layer = Int4Linear.from_codes(codes, scales, zeros, None, torch.bfloat16)
    else:
        layer = _q8_layer(kind, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    weight = layer.dequantize(torch.bfloat16).double()
    exact = x.double() @ weight.T
    y = layer.packed_matmul(x, tiles_from=1)
    bound = 2**-8 * exact.abs() + 2**-20 * (x.double().abs() @ weight.abs().T)
    assert ((y.double() - exact).abs() <= bound).all(), ((y.double() - exact).abs() - bound).max()
    for row in (0, rows - 1):
        assert torch.equal(layer.packed_matmul(x[row : row + 1], tiles_from=1), y[row : row + 1])
    # below tiles_from the integer dot products run: other bits (the inputs quantized to int8)
    if rows > 1:
        assert not torch.equal(layer.packed_matmul(x, tiles_from=rows + 1), y)


@pytest.mark.parametrize("layout", ["int4", "q8", "q8-zeros", "q8-halves"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_lookup_gives_the_bits_of_torchs_operations(layout, dtype, monkeypatch):
    """The C++ row lookup (``quantized_rows``, an embedding tied to the head) against the same
    rows computed by torch's operations, for every row of a layer of each layout and scales in
    each dtype (float32's products round: kept apart from the zero's add)."""
    gen = torch.Generator().manual_seed(7)
    out_features, in_features = 48, 96
    groups = in_features // GROUP_SIZE
    zeros = torch.randn(out_features, groups, generator=gen)
    if layout == "int4":
        codes, _, _, _ = _case(out_features, in_features, 1)
        scales = torch.rand(out_features, groups, generator=gen) / 7 + 1e-3
        # the blocked layout, whose kernels take bfloat16 only, holds scales of any dtype alike
        monkeypatch.setattr(layers, "blocked_kernel_available", lambda dtype=None: True)
        layer = Int4Linear.from_codes(codes, scales, zeros / 3, None, dtype)
        assert layer.blocked
    else:
        q = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
        per = 16 if layout == "q8-halves" else GROUP_SIZE
        d = torch.rand(out_features, in_features // per, generator=gen) / 7 + 1e-3
        layer = Q8Linear.from_blocks(
            q, d, None, dtype, zeros=zeros / 3 if layout == "q8-zeros" else None
        )
    ids = torch.cat([torch.arange(out_features), torch.tensor([5, 5, 47, 0])])
    got = layer.rows(ids)
    assert got.dtype == dtype and torch.equal(got, layer.torch_rows(ids))
    assert layer.rows(ids[:0]).shape == (0, in_features)
    with pytest.raises(RuntimeError, match=r"quantized_rows: ids must lie in \[0, 48\), got 48"):
        layer.rows(torch.tensor([3, 48]))
    with pytest.raises(RuntimeError, match=r"quantized_rows: ids must lie in \[0, 48\), got -1"):
        layer.rows(torch.tensor([-1]))
