"""Linear layers packed for oneDNN: the same products as nn.Linear, and the engine's native
models use them."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_core
from torch import nn

from llmrpc.kernels.linear import PackedLinear, can_pack, pack_linear_layers

DTYPES = [d for d in (torch.float32, torch.bfloat16) if can_pack(d, torch.device("cpu"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 32, 257])
def test_same_products_as_linear(dtype, bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    expected = linear(x)
    out = PackedLinear(linear)(x)
    assert out.dtype == dtype and out.shape == expected.shape
    if dtype == torch.bfloat16:  # the same oneDNN kernel, without the reorder per call
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_any_leading_shape_and_strided_input():
    linear = nn.Linear(64, 32)
    packed = PackedLinear(linear)
    x = torch.randn(2, 5, 128)[..., ::2]  # not contiguous
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_wrong_width_is_refused():
    with pytest.raises(ValueError, match="input has 10 features, the layer takes 64"):
        PackedLinear(nn.Linear(64, 32))(torch.randn(3, 10))


def test_packs_plain_linears_and_keeps_tied_embedding():
    embedding = nn.Embedding(50, 16)
    model = nn.ModuleDict(
        {"embed": embedding, "proj": nn.Linear(16, 16), "head": nn.Linear(16, 50, bias=False)}
    )
    model["head"].weight = embedding.weight
    assert pack_linear_layers(model) == 2
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert model["embed"].weight is embedding.weight  # the embedding still has its table
    ids = torch.tensor([3, 7])
    torch.testing.assert_close(
        model["head"](model["embed"](ids)), model["embed"](ids) @ embedding.weight.T
    )


def test_float16_is_left_as_it_is():
    assert not can_pack(torch.float16, torch.device("cpu"))
    model = nn.Sequential(nn.Linear(8, 8).half())
    assert pack_linear_layers(model) == 0 and type(model[0]) is nn.Linear


def test_engine_packs_its_native_model(tiny_llama_dir):
    core = make_core(tiny_llama_dir)
    layer = core.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(module, PackedLinear)
    assert isinstance(core.model.lm_head, PackedLinear)
