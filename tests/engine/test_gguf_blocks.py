"""GGUF block types read from their bytes (engine/quantization/gguf_blocks.py) against gguf's own
dequantization, and the layers packed from them against a float64 product.

Blocks are random bytes with finite float16 fields: every byte pattern is a valid block, so each
nibble, high-bit plane and 6-bit scale field takes values a real file can hold.
"""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from llmrpc.engine.quantization.gguf_blocks import BLOCK_BYTES, _packed_linear, read_blocks
from llmrpc.engine.quantization.layers import (
    Int4Linear,
    Q8BlockLinear,
    Q8Linear,
    blocked_kernel_available,
)

# Offsets of each type's float16 fields in its block (d; and m, or dmin)
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
TYPES = sorted(BLOCK_BYTES)


def random_tensor(name: str, rows: int, columns: int, seed: int = 0) -> SimpleNamespace:
    """A tensor as ``gguf.GGUFReader`` gives it: ``[rows, bytes of a row]`` uint8."""
    qtype = gguf.GGMLQuantizationType[name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, columns // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[name]:
        values = (rng.random((rows, columns // block_size)) * 0.02 + 1e-3).astype(np.float16)
        if offset == 2 and name.endswith("_1"):  # Q4_1 / Q5_1's m: a signed offset
            values = (values * np.sign(rng.random(values.shape) - 0.5)).astype(np.float16)
        blocks[..., offset : offset + 2] = values[..., None].view(np.uint8)
    return SimpleNamespace(tensor_type=qtype, data=blocks.reshape(rows, -1))


def oracle(tensor) -> np.ndarray:
    """gguf's dequantization of the tensor, float64 ``[rows, columns]``."""
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float64)


def reconstructed(blocks) -> np.ndarray:
    rows, columns = blocks.codes.shape
    scales = np.repeat(blocks.scales.astype(np.float64), blocks.group, axis=1)
    weight = blocks.codes.astype(np.float64) * scales
    if blocks.zeros is not None:
        weight += np.repeat(blocks.zeros.astype(np.float64), 32, axis=1)
    return weight


@pytest.mark.parametrize("name", TYPES)
def test_blocks_read_as_gguf_dequantizes_them(name):
    """codes * scale + zero is gguf's dequantization to float32 rounding (gguf computes in
    float32: d * sc * q - dmin * m rounds once or twice). A nibble, bit plane or scale field read
    from the wrong place is off by a whole quantization step (about 1e-3 here, 100x the bound)."""
    tensor = random_tensor(name, 32, 512, seed=len(name))
    blocks = read_blocks(tensor)
    expected = oracle(tensor)
    assert blocks.codes.shape == expected.shape and blocks.codes.dtype == np.int8
    assert blocks.group == (16 if name == "Q6_K" else 32)
    assert (blocks.zeros is not None) == (name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
    span = {"Q4": (-8, 7), "Q5": (-16, 15), "Q6": (-32, 31), "Q8": (-128, 127)}[name[:2]]
    assert blocks.codes.min() >= span[0] and blocks.codes.max() <= span[1]
    assert blocks.codes.min() == span[0] and blocks.codes.max() == span[1]  # every bit read
    error = np.abs(reconstructed(blocks) - expected)
    assert error.max() <= 2**-22 * np.abs(expected).max(), error.max()


@pytest.mark.parametrize("name", TYPES)
def test_packed_layer_is_the_float64_product_of_the_blocks(name):
    """The layer packed from each type against the float64 product of gguf's dequantized weight
    with the bfloat16 inputs: each output within 1% of its sum of |x| |w| where our bfloat16
    kernels run (inputs quantized to int8 per 32, a step of up to 1/254 of a group's largest;
    scales and zeros held in bfloat16, 2^-9), and to float32 rounding in float32 (the weight
    dequantized, then a dense matmul). 4-bit types pack as int4, the others as int8 codes."""
    tensor = random_tensor(name, 48, 256, seed=7)
    weight = oracle(tensor)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        layer = _packed_linear(read_blocks(tensor), None, dtype)
        if name[:2] == "Q4":
            assert isinstance(layer, Int4Linear)
        elif blocked_kernel_available(dtype):
            assert isinstance(layer, Q8Linear)
        elif name != "Q6_K":
            assert isinstance(layer, Q8BlockLinear)
        else:  # a scale per 16 has no packing without our kernel: kept as loaded
            assert layer is None
            continue
        inputs = x.to(dtype)
        expected = inputs.double().numpy() @ weight.T
        magnitude = np.abs(inputs.double().numpy()) @ np.abs(weight).T
        y = layer(inputs).double().numpy()
        bound = 0.01 if dtype == torch.bfloat16 else 2**-20
        assert (np.abs(y - expected) <= bound * magnitude).all(), (dtype, name)
        if dtype == torch.float32:
            assert np.abs(layer.dequantize(torch.float32).double().numpy() - weight).max() <= (
                2**-22 * np.abs(weight).max()
            )


def test_fused_parts_of_mixed_types_share_one_layout():
    """q/k in Q5_0 with v in Q6_K: one int8-code layer with a scale per 16; with a Q4_K part
    (zeros) beside Q6_K (a scale per 16) no kernel takes both, and the layer is kept."""
    from llmrpc.engine.quantization.gguf_blocks import _module_blocks

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    parts = {0: random_tensor("Q5_0", 64, 256, 1), 1: random_tensor("Q5_0", 32, 256, 2)}
    parts[2] = random_tensor("Q6_K", 32, 256, 3)
    blocks = _module_blocks("layers.0.self_attn.qkv_proj", parts, "gemma3", config)
    assert blocks.types == ("Q5_0", "Q5_0", "Q6_K") and blocks.group == 16
    expected = np.concatenate([oracle(parts[i]) for i in range(3)])
    assert np.abs(reconstructed(blocks) - expected).max() <= 2**-22 * np.abs(expected).max()
    parts[0] = random_tensor("Q4_K", 64, 256, 4)
    assert _module_blocks("layers.0.self_attn.qkv_proj", parts, "gemma3", config) is None
