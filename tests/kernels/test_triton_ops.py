"""The Triton kernels as torch operations (``kernel_ops/triton_ops.py``), what ``torch.compile``
of a Triton-backend step is built from: ``torch.library.opcheck`` holds each to its registration
(the schema names every tensor it writes, the fake gives the real output's shape, dtype and
strides, the operation runs traced and functionalized), and each gives its wrapper's result,
called eager and from a compiled function. Interpreted on the CPU, natively under ``gpu``."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from llmrpc.kernels import triton_ops

BLOCK_SIZE, NUM_BLOCKS, KV_HEADS, HEADS, HEAD_DIM = 16, 6, 2, 4, 32


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def _randn(*shape: int, device, seed: int, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def _cases(device) -> dict[str, tuple]:
    """Each operation with inputs of a 3-sequence decode step (random, never zeros)."""
    caches = [
        _randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, seed=s) for s in (1, 2)
    ]
    tables = torch.tensor([[0, 3], [1, 4], [5, 2]], device=device)
    seq_lens = torch.tensor([20, 1, 32], device=device)
    hidden = _randn(3, 64, device=device, seed=3)
    qk = _randn(3, HEADS, HEAD_DIM, device=device, seed=4)
    cos, sin = (_randn(3, 1, HEAD_DIM, device=device, seed=s) for s in (5, 6))
    return {
        "store_kv": (
            _randn(3, KV_HEADS, HEAD_DIM, device=device, seed=7),
            _randn(3, KV_HEADS, HEAD_DIM, device=device, seed=8),
            *caches,
            torch.tensor([19, -1, 88], device=device),  # -1: a padding row, not stored
            1.0,
            1.0,
        ),
        "decode_attention": (
            _randn(3, HEADS, HEAD_DIM, device=device, seed=9),
            *caches,
            tables,
            seq_lens,
            HEAD_DIM**-0.5,
            1.0,
            1.0,
            20,  # an attention window
        ),  # fmt: skip
        "rms_norm": (hidden, _randn(64, device=device, seed=10), 1e-6),
        "add_rms_norm": (
            hidden,
            _randn(3, 64, device=device, seed=11),
            _randn(64, device=device, seed=12),
            1e-6,
        ),  # fmt: skip
        "rotary": (qk, cos, sin),
    }


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize(
    "name", ["store_kv", "decode_attention", "rms_norm", "add_rms_norm", "rotary"]
)
def test_each_operation_is_registered_as_it_runs(device, name):
    operation = getattr(torch.ops.llmrpc_triton, name)
    torch.library.opcheck(operation, _cases(device)[name])


def _step(key, value, key_cache, value_cache, slots, query, tables, seq_lens, x, residual, w):
    """The Triton backend's calls of a decode layer, through the functions the dispatchers call:
    the operations while compiling, the wrappers eager."""
    triton_ops.store_kv(key, value, key_cache, value_cache, slots, 1.0, 1.0)
    cos, sin = query[:, :1].cos(), query[:, :1].sin()  # computed in the graph: inductor's own
    attention = triton_ops.decode_attention(
        triton_ops.rotary(query, cos, sin), key_cache, value_cache, tables, seq_lens,
        HEAD_DIM**-0.5, 1.0, 1.0,
    )  # fmt: skip
    normed, summed = triton_ops.add_rms_norm(x, residual, w, 1e-6)
    return attention, triton_ops.rms_norm(normed, w, 1e-6), summed


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_step_of_the_operations_gives_eager_results(device, backend):
    """Compiled with fullgraph=True: a wrapper traced into (its launch) would break the graph.
    The in-place kernels write the caller's KV cache and residual, as eager does."""
    cases = _cases(device)
    key, value, key_cache, value_cache, slots, *_ = cases["store_kv"]
    query, _, _, tables, seq_lens, *_ = cases["decode_attention"]
    x, residual, w, _ = cases["add_rms_norm"]
    args = (key, value, key_cache, value_cache, slots, query, tables, seq_lens, x, residual, w)
    eager_args, compiled_args = _clone(args), _clone(args)
    expected = _step(*eager_args)
    got = torch.compile(_step, fullgraph=True, backend=backend)(*compiled_args)
    for actual, wanted in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, wanted)
    for index in (2, 3, 8, 9):  # key_cache, value_cache, x, residual
        torch.testing.assert_close(compiled_args[index], eager_args[index], rtol=0, atol=0)
    assert not torch.equal(compiled_args[2], key_cache)  # the store wrote slots 19 and 88
