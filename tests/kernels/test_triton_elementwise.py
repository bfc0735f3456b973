"""The Triton elementwise kernels against their torch twins (``kernel_ops/elementwise.py``): in
Triton's interpreter on the CPU (conftest sets ``TRITON_INTERPRET=1`` without a GPU), and the same
tests natively on CUDA under the ``gpu`` mark.

Tolerances, per dtype: float32 5e-6 relative (the kernel sums the squares in another order than
torch's mean, and rsqrt may differ in its last bit); bfloat16 and float16 two units in the last
place (2**-6 and 2**-9 relative) on at most 1% of the elements: ``x * rstd`` in float32 can land
on the other side of a rounding boundary, one unit of the normed value, which a weight above 1
can make two in the product. Measured in the interpreter on 600 rows of 64, 576 and 96: rms_norm
float32 4.1e-7 relative at most, bfloat16 exact, float16 one element in 10,000 off (by up to two
units, 1.3e-3 relative); the sum of add + norm and rotary (384 rows) are exact in every dtype.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES
from triton_compile_keys import recorded_compile_keys

from llmrpc.engine.models.rotary import RotaryEmbedding
from llmrpc.kernels.elementwise import rms_norm_torch, rotary_torch
from llmrpc.kernels.triton_elementwise import add_rms_norm, rms_norm, rotary
from llmrpc.kernels.triton_utils import interpreting

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RTOL = {torch.float32: 5e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
EPS = 1e-6


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def norm_weight(hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return 1 + 0.1 * randn(hidden, dtype=torch.float32, device=device, seed=99).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL[expected.dtype], atol=1e-6)
    if expected.dtype != torch.float32:
        assert (actual != expected).float().mean() <= 0.01


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 96])
def test_rms_norm_matches_twin(device, dtype, hidden):
    x = randn(5, hidden, dtype=dtype, device=device, seed=hidden)
    weight = norm_weight(hidden, dtype, device)
    # out is a view into a wider buffer: the masked tail of each row must stay untouched
    buffer = poisoned((5, hidden + 7), dtype, device)
    out = rms_norm(x, weight, EPS, out=buffer[:, :hidden])
    assert out.data_ptr() == buffer.data_ptr()
    assert_close(out, rms_norm_torch(x, weight, EPS))
    assert buffer[:, hidden:].isnan().all()
    assert_close(rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS))  # a new tensor


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_per_head_of_a_strided_view(device, dtype):
    # q of a fused qkv projection, normed per head (as Qwen3's q-norm does)
    tokens, heads, head_dim = 3, 4, 96
    qkv = randn(tokens, 3 * heads * head_dim, dtype=dtype, device=device, seed=1)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = norm_weight(head_dim, dtype, device)
    out = rms_norm(q, weight, EPS, out=poisoned(q.shape, dtype, device))
    assert_close(out, rms_norm_torch(q, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 96])
def test_add_rms_norm_matches_twin_in_place(device, dtype, hidden):
    x = randn(4, hidden, dtype=dtype, device=device, seed=hidden)
    residual = randn(4, hidden, dtype=dtype, device=device, seed=hidden + 1)
    weight = norm_weight(hidden, dtype, device)
    expected_sum = x + residual
    expected = rms_norm_torch(expected_sum, weight, EPS)
    normed, new_residual = add_rms_norm(x, residual, weight, EPS)
    assert normed.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, expected_sum)  # one rounding of an exact sum: exact
    assert_close(normed, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rotary_of_a_strided_view_matches_twin(device, dtype, head_dim, rope):
    tokens, heads, kv_heads = 5, 4, 2
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device, seed=7)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    assert k.stride(0) != kv_heads * head_dim  # the layout the kernel must take as it is
    positions = torch.tensor([0, 1, 17, 4095, 100_000], device=device)  # past llama3's 8192
    cos, sin = RotaryEmbedding(head_dim, ROPES[rope]).to(device).cos_sin(positions, dtype)
    out = rotary(k, cos, sin, out=poisoned(k.shape, dtype, device))
    assert_close(out, rotary_torch(k, cos, sin))


def test_rotary_in_place(device):
    x = randn(3, 2, 64, dtype=torch.bfloat16, device=device, seed=3)
    cos, sin = (
        RotaryEmbedding(64, ROPES["default"])
        .to(device)
        .cos_sin(torch.arange(3, device=device), x.dtype)
    )
    expected = rotary_torch(x, cos, sin)
    assert rotary(x, cos, sin, out=x) is x
    assert_close(x, expected)


def test_layout_contract_errors_name_the_argument(device):
    x = randn(2, 64, dtype=torch.float32, device=device, seed=0)
    weight = norm_weight(64, torch.float32, device)
    with pytest.raises(ValueError, match="^weight has dtype"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match="^x's last dimension is not contiguous"):
        rms_norm(randn(64, 2, dtype=torch.float32, device=device, seed=0).t(), weight, EPS)
    with pytest.raises(ValueError, match="^out has shape"):
        rms_norm(x, weight, EPS, out=torch.empty(2, 32, device=device))
    with pytest.raises(ValueError, match="^weight is on meta"):
        rms_norm(x, weight.to("meta"), EPS)
    with pytest.raises(ValueError, match="^residual has shape"):
        add_rms_norm(x, x[:1].clone(), weight, EPS)
    with pytest.raises(ValueError, match="^x has dtype"):
        add_rms_norm(x.double(), x.double(), weight, EPS)
    q = randn(3, 2, 64, dtype=torch.float32, device=device, seed=0)
    cos = sin = torch.ones(3, 1, 64, device=device)
    with pytest.raises(ValueError, match="^cos has shape"):
        rotary(q, cos[:2], sin)
    with pytest.raises(ValueError, match="^sin has dtype"):
        rotary(q, cos, sin.half())
    with pytest.raises(ValueError, match="^sin is on meta"):
        rotary(q, cos, sin.to("meta"))
    with pytest.raises(ValueError, match="^x's last dimension is not contiguous"):
        rotary(q.transpose(1, 2), cos, sin)


@pytest.mark.skipif(not interpreting(), reason="records the compiles of the interpreter's launches")
def test_steps_of_any_size_compile_one_variant_of_each_kernel():
    """A server's steps have 1, 16, 17 or any number of tokens (Triton specialises an integer
    on 1 and on multiples of 16): on a GPU one compiled variant of each kernel serves them all,
    so no step waits for a compile that the first one did not make."""
    cpu = torch.device("cpu")
    weight = norm_weight(64, torch.float32, cpu)
    cos, sin = (randn(17, 1, 16, dtype=torch.float32, device=cpu, seed=s) for s in (1, 2))
    with recorded_compile_keys() as keys:
        for tokens in (1, 16, 17):
            x = randn(tokens, 64, dtype=torch.float32, device=cpu, seed=tokens)
            assert_close(rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS))
            add_rms_norm(x, x.clone(), weight, EPS)
            heads = x.view(tokens, 4, 16)
            assert_close(
                rotary(heads, cos[:tokens], sin[:tokens]),
                rotary_torch(heads, cos[:tokens], sin[:tokens]),
            )
    # rms_norm with and without a residual
    assert {name: len(found) for name, found in keys.items()} == {
        "_rms_norm_kernel": 2,
        "_rotary_kernel": 1,
    }
