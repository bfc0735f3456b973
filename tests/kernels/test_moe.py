"""The Mixture-of-Experts layer (kernel_ops/moe.py, kernel_ops/triton_moe.py): ``route`` against a
direct float32 softmax and top-k and against Transformers' Mixtral router; ``fused_experts`` on
both backends against a per-(token, slot) loop in float64 (the oracle) and, in float32, against
Transformers' Mixtral experts; the Triton kernels in Triton's interpreter on the CPU (conftest sets
``TRITON_INTERPRET=1`` without a GPU) and natively on CUDA under the ``gpu`` mark; the alignment
layout; ``torch.compile(fullgraph=True)`` over a call; the registered operation; the errors.

Poison: the weights of every expert that no kept slot routes to are NaN (experts no token picks,
and the experts whose slots are dropped as -1), so reading them shows up as NaN in the result.

Tolerances, per dtype, on results of magnitude up to about 3.7 (hidden rows N(0, 1), weights
scaled so that each projection's output is about N(0, 1)): the oracle never rounds, where both
paths round the gate/up product, the activation and the down product to the dtype (and the
Triton path the weighted product once more), each a sum of H or I products. Measured over CASES
on a 2-core Intel Xeon (Triton interpreted; the twin with and without the C++ silu_and_mul):
against the oracle the twin differs by at most 0.022 (bfloat16), 0.0021 (float16), 1.8e-6
(float32), the Triton path by 0.022, 0.0021, 1.0e-6; the two paths from each other by one unit
in the last place (0.016 bfloat16, 0.002 float16 on values in [2, 4)) and 1.7e-6 (float32).
"""

from __future__ import annotations

import pytest
import torch
from compiled_ptx import compiled_ptx
from kernel_devices import DEVICES

from llmrpc.kernels.moe import fused_experts, route
from llmrpc.kernels.triton_moe import align_by_expert

TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}
DTYPES = [pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in TOLERANCE]
NAN = float("nan")
# name -> (T, H, I, E, k, routing): H and I multiples of no tile (16, 32, 64)
#   "random": router logits N(0, 1); "subset": only experts 1, 3 and 4 can win;
#   "ties": every other token's logits tie among k + 2 experts; "dropped": the slots routed to
#   experts 4 and up are -1 (an expert-parallel rank holding experts 0-3), token 0's all of them
CASES = {
    "E8-k2-decode": (1, 72, 44, 8, 2, "random"),
    "E8-k2-prefill": (100, 72, 44, 8, 2, "random"),
    "E4-k1": (37, 88, 24, 4, 1, "random"),
    "E6-k3": (29, 40, 72, 6, 3, "random"),
    "E8-k2-subset": (45, 72, 44, 8, 2, "subset"),
    "E6-k2-ties": (20, 40, 44, 6, 2, "ties"),
    "E8-k2-dropped": (70, 72, 44, 8, 2, "dropped"),
}
CASE_PARAMS = [pytest.param(name, id=name) for name in CASES]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def router_logits(num_tokens: int, num_experts: int, top_k: int, routing: str) -> torch.Tensor:
    logits = randn(num_tokens, num_experts, seed=7)
    if routing == "subset":
        allowed = torch.zeros(num_experts, dtype=torch.bool)
        allowed[[1, 3, 4]] = True
        logits[:, ~allowed] = -torch.inf
    elif routing == "ties":
        logits[::2, 1 : top_k + 3] = 3.0  # k + 2 experts share the largest logit
    return logits


def make_case(name: str, dtype: torch.dtype, device):
    """(hidden, w13, w2, topk_weights, topk_ids) in ``dtype`` on ``device``, routed by ``route``
    and poisoned as the module docstring says."""
    num_tokens, hidden_size, inter, num_experts, top_k, routing = CASES[name]
    weights, ids = route(router_logits(num_tokens, num_experts, top_k, routing), top_k, True)
    if routing == "dropped":
        ids[ids >= 4] = -1
        ids[0] = -1
    hidden = randn(num_tokens, hidden_size, seed=1)
    w13 = randn(num_experts, 2 * inter, hidden_size, seed=2, scale=hidden_size**-0.5)
    w2 = randn(num_experts, hidden_size, inter, seed=3, scale=inter**-0.5)
    used = torch.zeros(num_experts, dtype=torch.bool)
    used[ids[ids >= 0].long()] = True
    w13[~used] = NAN
    w2[~used] = NAN
    return (
        hidden.to(device, dtype),
        w13.to(device, dtype),
        w2.to(device, dtype),
        weights.to(device),
        ids.to(device),
    )


def oracle(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The layer one token and one slot at a time, in float64 from the same (rounded) inputs."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        x = hidden[token].double().cpu()
        for slot, expert in enumerate(topk_ids[token].tolist()):
            if expert == -1:
                continue
            gate, up = (w13[expert].double().cpu() @ x).chunk(2)
            y = w2[expert].double().cpu() @ (torch.nn.functional.silu(gate) * up)
            out[token] += topk_weights[token, slot].double().cpu() * y
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_torch_path_matches_the_oracle(dtype, case):
    args = make_case(case, dtype, "cpu")
    got = fused_experts(*args, backend="torch")
    assert got.dtype == dtype and got.shape == args[0].shape
    assert not got.isnan().any(), "an expert with no kept slot was read"
    torch.testing.assert_close(got.double(), oracle(*args), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_triton_path_matches_the_oracle(device, dtype, case):
    args = make_case(case, dtype, device)
    got = fused_experts(*args, backend="triton")
    assert got.dtype == dtype and got.shape == args[0].shape and got.device == device
    assert not got.isnan().any(), "an expert with no kept slot was read"
    torch.testing.assert_close(got.double().cpu(), oracle(*args), **TOLERANCE[dtype])


def test_int64_ids_and_an_empty_batch(device):
    hidden, w13, w2, weights, ids = make_case("E8-k2-dropped", torch.float32, device)
    for backend in ("torch", "triton"):
        expected = fused_experts(hidden, w13, w2, weights, ids, backend=backend)
        got = fused_experts(hidden, w13, w2, weights, ids.long(), backend=backend)
        assert torch.equal(got, expected)
        assert torch.equal(got[0], torch.zeros_like(got[0]))  # token 0: every slot dropped
        empty = fused_experts(hidden[:0], w13, w2, weights[:0], ids[:0], backend=backend)
        assert empty.shape == (0, hidden.shape[1]) and empty.dtype == hidden.dtype


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalize", "raw"])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_route_is_a_float32_softmax_then_topk(renormalize, logits_dtype):
    top_k = 2
    logits = router_logits(12, 6, top_k, "ties").to(logits_dtype)
    weights, ids = route(logits, top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    expected_weights, expected_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        expected_weights = expected_weights / expected_weights.sum(dim=-1, keepdim=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, expected_ids.int())
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=0)
    expected_sum = torch.ones(12) if renormalize else expected_weights.sum(dim=-1)
    torch.testing.assert_close(weights.sum(dim=-1), expected_sum)
    # the tied rows: k different experts among the k + 2 that tie, with equal weights
    tied = ids[::2]
    assert ((tied >= 1) & (tied < top_k + 3)).all()
    assert (tied[:, 0] != tied[:, 1]).all()
    assert torch.equal(weights[::2, 0], weights[::2, 1])


def test_route_refuses_a_bad_top_k():
    for top_k in (0, 7):
        with pytest.raises(ValueError, match=f"top_k must be 1 to 6, got {top_k}"):
            route(torch.zeros(2, 6), top_k, True)


def _mixtral_config(num_experts: int, top_k: int, hidden_size: int, inter: int):
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=hidden_size,
        intermediate_size=inter,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
    )


def mixtral_block() -> tuple[torch.Tensor, ...]:
    """A float32 Mixtral sparse block of Transformers on random weights: (hidden, w13, w2, its
    router's logits, its routing weights and ids, its experts' output)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter

    num_tokens, hidden_size, inter, num_experts, top_k = 33, 72, 44, 8, 2
    config = _mixtral_config(num_experts, top_k, hidden_size, inter)
    router, experts = MixtralTopKRouter(config), MixtralExperts(config)
    with torch.no_grad():
        router.weight.copy_(randn(num_experts, hidden_size, seed=4))
        experts.gate_up_proj.copy_(randn(*experts.gate_up_proj.shape, seed=2, scale=0.12))
        experts.down_proj.copy_(randn(*experts.down_proj.shape, seed=3, scale=0.15))
        hidden = randn(num_tokens, hidden_size, seed=1)
        logits, weights, ids = router(hidden)
        expected = experts(hidden, ids, weights)
    return hidden, experts.gate_up_proj.data, experts.down_proj.data, logits, weights, ids, expected


def test_route_and_torch_path_match_transformers_mixtral():
    hidden, w13, w2, logits, expected_weights, expected_ids, expected = mixtral_block()
    weights, ids = route(logits, expected_ids.shape[1], renormalize=True)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=0)
    got = fused_experts(hidden, w13, w2, weights, ids, backend="torch")
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_triton_path_matches_transformers_mixtral(device):
    hidden, w13, w2, _, weights, ids, expected = mixtral_block()
    args = (t.to(device) for t in (hidden, w13, w2, weights, ids))
    got = fused_experts(*args, backend="triton")
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[torch.float32])


def test_align_by_expert_layout():
    # pairs (t * k + j) 0..5 route to experts 2, 0, 2, -1, 0, 2; E = 4, BLOCK_M = 4
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]], dtype=torch.int32)
    sorted_pairs, block_experts = align_by_expert(ids, num_experts=4, block_m=4)
    sentinel = 6
    # cdiv(6 + 4 * 3, 4) = 5 blocks: expert 0's two pairs, expert 2's three, each padded to 4
    assert sorted_pairs.tolist() == [1, 4] + [sentinel] * 2 + [0, 2, 5] + [sentinel] * 13
    assert block_experts.tolist() == [0, 2, -1, -1, -1]
    assert sorted_pairs.dtype == block_experts.dtype == torch.int32
    # a run of exactly BLOCK_M pairs takes one block, with no padding; all dropped: no blocks
    sorted_pairs, block_experts = align_by_expert(torch.tensor([[1, 1], [1, 1]]), 2, 4)
    assert sorted_pairs.tolist()[:4] == [0, 1, 2, 3] and block_experts.tolist()[:2] == [1, -1]
    _, block_experts = align_by_expert(torch.full((3, 2), -1), 2, 16)
    assert (block_experts == -1).all()


def _layer(hidden, w13, w2, logits):
    """A MoE block's calls as a model makes them, with graph work on both sides."""
    weights, ids = route(logits, 2, renormalize=True)
    return fused_experts(hidden * 2, w13, w2, weights, ids) + hidden


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_fullgraph_compile_equals_eager(compiler):
    hidden, w13, w2, _, _ = make_case("E8-k2-prefill", torch.float32, "cpu")
    w13, w2 = w13.nan_to_num(), w2.nan_to_num()
    logits = router_logits(hidden.shape[0], 8, 2, "random")
    compiled = torch.compile(_layer, fullgraph=True, backend=compiler)
    expected = _layer(hidden, w13, w2, logits)
    torch.testing.assert_close(compiled(hidden, w13, w2, logits), expected)
    # other routing, same shapes: the loop over experts is not baked into the graph
    torch.testing.assert_close(compiled(hidden, w13, w2, -logits), _layer(hidden, w13, w2, -logits))


def test_the_operation_is_registered_as_it_runs(device):
    args = make_case("E6-k3", torch.float32, device)
    for backend in ("torch", "triton"):
        torch.library.opcheck(torch.ops.llmrpc.fused_experts, (*args, backend))


def test_both_kernels_compile_for_the_gpu_with_tensor_core_dots(tmp_path):
    """The bfloat16 kernels as Triton compiles them for an H100/H200 (sm_90), which the
    interpreter never does: they compile, and their dots run on tensor cores."""
    common = dict(sorted_pairs_ptr="*i32", block_experts_ptr="*i32", num_pairs="i32")
    blocks = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, DOT_F32=False)
    kernels = {
        "_gate_up_kernel": (
            dict(hidden_ptr="*bf16", w13_ptr="*bf16", gate_up_ptr="*bf16", **common),
            ("hidden_size", "gate_up_size", "stride_ht", "stride_we", "stride_wn", "stride_gt"),
            dict(TOP_K=2, **blocks),
        ),
        "_down_kernel": (
            dict(gate_up_ptr="*bf16", w2_ptr="*bf16", weights_ptr="*fp32", out_ptr="*bf16"),
            ("hidden_size", "inter_size", "stride_gt", "stride_we", "stride_wn", "stride_ot"),
            blocks,
        ),
    }
    for name, (pointers, integers, constexprs) in kernels.items():
        signature = {**pointers, **common, **dict.fromkeys(integers, "i32")}
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        ptx = compiled_ptx("llmrpc.kernels.triton_moe", name, signature, constexprs, tmp_path)
        assert "wgmma" in ptx or "mma.sync" in ptx, f"{name}: no tensor-core dot"


def test_bad_arguments_raise_value_errors_naming_them():
    hidden, w13, w2, weights, ids = make_case("E6-k3", torch.float32, "cpu")
    cases = [
        ((hidden, w13, w2, weights, ids, "cuda"), "^backend must be one of"),
        ((hidden[0], w13, w2, weights, ids), r"^hidden must be \[T, H\]"),
        ((hidden, w13[:, :, :8], w2, weights, ids), r"^w13 must be \[E, 2\*I, 40\]"),
        ((hidden, w13, w2[:, :, :8], weights, ids), r"^w2 must be \(6, 40, 72\)"),
        ((hidden, w13, w2.double(), weights, ids), "^w2 is torch.float64"),
        ((hidden, w13, w2, weights, ids[:3]), r"^topk_ids must be \[29, k\]"),
        ((hidden, w13, w2, weights, ids.float()), "^topk_ids is torch.float32"),
        ((hidden, w13, w2, weights[:, :2], ids), "^topk_weights must be float"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            fused_experts(*args)


def test_triton_layout_contract_errors_name_the_argument(device):
    hidden, w13, w2, weights, ids = make_case("E6-k3", torch.float32, device)
    cases = [
        ((hidden.double(), w13.double(), w2.double(), weights, ids), "^hidden is torch.float64"),
        ((hidden, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids), "^w13 must"),
        ((hidden, w13, w2, weights, ids.to("meta")), "^topk_ids is on meta"),
        ((hidden, w13, w2, weights.to("meta"), ids), "^topk_weights is on meta"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            fused_experts(*args, backend="triton")


def test_one_tokens_short_path_adds_as_the_grouping_does():
    """A single token skips the grouping (``grouped_experts``' one-token path): with experts
    whose rows do not depend on each other, its output equals its row in a batch bit for bit,
    in float32 with four experts a token and a dropped slot (added in slot order rather than
    by expert id, every row differs here; bfloat16's rounding of the sum would hide it)."""
    from llmrpc.kernels.moe import grouped_experts

    torch.manual_seed(0)
    hidden_size, num_experts = 4096, 8
    scales = torch.randn(num_experts, hidden_size)

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        return rows * scales[index]  # row by row: a row's result ignores the others

    hidden = torch.randn(4, hidden_size)
    weights, ids = route(torch.randn(4, num_experts), 4, renormalize=True)
    ids[2, 1] = -1
    batch = grouped_experts(hidden, weights, ids, num_experts, expert)
    for row in range(4):
        alone = grouped_experts(hidden[row : row + 1], weights[row : row + 1],
                                ids[row : row + 1], num_experts, expert)  # fmt: skip
        assert torch.equal(alone[0], batch[row]), row
