"""The Triton sampling kernel against its twin ``sample_torch`` and against the kept sets of
``engine/sample/sampler.py``: in Triton's interpreter on the CPU (conftest sets
``TRITON_INTERPRET=1`` without a GPU), and the same tests natively on CUDA under the ``gpu`` mark.

Kernel and twin select the same top-k sets exactly, on every device: ``logits / temperature`` is
an IEEE division in both. Weights (``exp``) and their sums are rounded differently (float32 and,
on a GPU, an approximate ``exp``; the twin sums in float64), so a top-p cut or a draw may differ
where a running weight lands within rounding of its target. The tests accept a difference only
there: the kernel's set must still be the smallest whose weight reaches ``top_p`` and its token
the one whose interval holds the draw, each within ``ROUNDING`` of the row's weight. On the
seeds here, in the interpreter, there is none. ``gpu_rounding`` makes the interpreter round ``/``
and ``exp`` as Triton's NVIDIA lowering does, so that the CPU checks what a GPU will compute.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from compiled_ptx import compiled_ptx
from kernel_devices import DEVICES

from llmrpc.engine.sample.sampler import _apply_top_k_top_p
from llmrpc.kernels.triton_sampling import kept_cutoff_torch, sample, sample_torch
from llmrpc.kernels.triton_utils import interpreting

NEG_INF = float("-inf")


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@contextlib.contextmanager
def no_host_sync(device: torch.device):
    """On CUDA, any synchronisation with the host inside raises."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def batch(logits, temperature, top_k, top_p, uniform, device):
    """The sampling arguments as ``sample`` takes them, on ``device``."""
    rows = logits.shape[0]

    def column(values, dtype):
        return torch.as_tensor(values, dtype=dtype).expand(rows).contiguous().to(device)

    return (
        logits.to(device),
        column(temperature, torch.float32),
        column(top_k, torch.int32),
        column(top_p, torch.float32),
        column(uniform, torch.float32),
    )


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random rows of distinct values, flat to peaked (scales 0.5 to 4.5)."""
    generator = torch.Generator().manual_seed(seed)
    scale = 0.5 + 4 * torch.rand(rows, 1, generator=generator)
    return torch.randn(rows, vocab, generator=generator) * scale


def _approximate_divide(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x / y`` as ``div.full.f32`` computes it: ``x`` times a rounded reciprocal of ``y``."""
    return np.multiply(x, np.reciprocal(y))


def _approximate_exp(x: np.ndarray) -> np.ndarray:
    """``exp(x)`` as ``ex2.approx`` computes it: ``2 ** (x * log2(e))``, the product rounded."""
    return np.exp2(np.multiply(x, x.dtype.type(math.log2(math.e))))


@triton.jit
def _probe_kernel(x_ptr, y_ptr, quotient_ptr, exp_ptr, exact_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x, y = tl.load(x_ptr + offs), tl.load(y_ptr + offs)
    tl.store(quotient_ptr + offs, x / y)
    tl.store(exp_ptr + offs, tl.exp(x))
    tl.store(exact_ptr + offs, tl.div_rn(x, y))


@pytest.fixture
def gpu_rounding(monkeypatch):
    """Triton's interpreter, rounding float32 ``/`` and ``exp`` as the NVIDIA lowering does
    (``div.full.f32``: within 2 ulp; ``ex2.approx`` of a rounded ``x * log2(e)``), modelled as
    ``x * (1 / y)`` and ``2 ** (x * log2(e))``: the same kind of error, which the interpreter's
    exact arithmetic hides. ``tl.div_rn`` stays exact. A probe kernel shows the model at work."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    divide = lambda self, lhs, rhs: self.binary_op(lhs, rhs, _approximate_divide)  # noqa: E731
    monkeypatch.setattr(builder, "create_fdiv", divide)
    monkeypatch.setattr(
        builder, "create_exp", lambda self, arg: self.unary_op(arg, _approximate_exp)
    )
    x = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 8
    y = torch.full((256,), 0.3)
    quotient, exp, exact = torch.empty(256), torch.empty(256), torch.empty(256)
    _probe_kernel[(1,)](x, y, quotient, exp, exact, BLOCK=256)
    assert torch.equal(exact, x / y)
    assert not torch.equal(quotient, x / y) and not torch.equal(exp, x.exp())


def run_both(args):
    """Kernel and twin: tokens, cuts and kept sets (``s >= cut``), on the CPU."""
    logits, temperature, top_k, top_p, uniform = args
    cutoff = torch.full_like(temperature, float("nan"))
    tokens = torch.full_like(temperature, -7, dtype=torch.int64)
    with no_host_sync(logits.device):
        sample(logits, temperature, top_k, top_p, uniform, out=tokens, cutoff_out=cutoff)
    logits, temperature, top_k, top_p, uniform = (t.cpu() for t in args)
    s = logits / torch.where(temperature > 0, temperature, 1).unsqueeze(1)
    twin_cutoff = kept_cutoff_torch(logits, temperature, top_k, top_p)
    return {
        "tokens": tokens.cpu(),
        "twin_tokens": sample_torch(logits, temperature, top_k, top_p, uniform),
        "cutoff": cutoff.cpu(),
        "twin_cutoff": twin_cutoff,
        "kept": s >= cutoff.cpu().unsqueeze(1),
        "twin_kept": s >= twin_cutoff.unsqueeze(1),
        "s": s,
    }


# How far from its target (a fraction of the weight it is taken of) a running weight may land
# for kernel and twin to differ: float32 sums over 49,152 tokens, on a GPU of approximate exps.
ROUNDING = 1e-5


def token_weights(s_row: torch.Tensor) -> torch.Tensor:
    """A row's token weights ``exp(s - max(s))`` in float64."""
    return (s_row - s_row.max()).double().exp()


def assert_top_p_cut_within_rounding(s_row, kept_row, top_k: int, top_p: float) -> None:
    """``kept_row`` is the row's top-p set but for rounding: the kept top-k survivors weigh at
    least ``top_p`` of the survivors' total, those above its least value less."""
    weight = token_weights(s_row)
    vocab = s_row.shape[0]
    survivors = s_row >= s_row.topk(top_k if 0 < top_k < vocab else vocab).values[-1]
    assert not (kept_row & ~survivors).any(), "top-p keeps only top-k survivors"
    total = weight[survivors].sum()
    cut = s_row[kept_row].min()
    assert torch.equal(kept_row, s_row >= cut), "the kept set is every token at or above a cut"
    assert weight[kept_row].sum() >= (top_p - ROUNDING) * total
    assert weight[survivors & (s_row > cut)].sum() < (top_p + ROUNDING) * total


def assert_draw_within_rounding(s_row, kept_row, uniform: float, token: int) -> None:
    """``token`` is the kept token whose interval of the running kept weight holds ``uniform``
    times the kept total, but for rounding."""
    weight = token_weights(s_row) * kept_row
    running = weight.cumsum(dim=0)
    total = running[-1]
    assert kept_row[token], "a drawn token is kept"
    assert running[token] > (uniform - ROUNDING) * total
    assert running[token] - weight[token] <= (uniform + ROUNDING) * total


def assert_matches_twin(result, args) -> None:
    """The kernel's kept sets and tokens are the twin's, but where a top-p cut or a draw fell
    within rounding of a boundary: there they still answer the definition, within rounding."""
    _, temperature, top_k, top_p, uniform = (t.cpu() for t in args)
    kept, twin_kept, s = result["kept"], result["twin_kept"], result["s"]
    for row in range(s.shape[0]):
        if temperature[row] <= 0:  # greedy: the first maximum, whatever the rounding
            assert result["tokens"][row] == result["twin_tokens"][row] == s[row].argmax()
            continue
        if torch.equal(kept[row], twin_kept[row]):
            assert result["cutoff"][row] == result["twin_cutoff"][row]  # the least kept value
        else:
            assert top_p[row] < 1, f"row {row}: top-k alone must select exactly the twin's set"
            assert_top_p_cut_within_rounding(s[row], kept[row], int(top_k[row]), float(top_p[row]))
        token = int(result["tokens"][row])
        if token != result["twin_tokens"][row]:
            assert_draw_within_rounding(s[row], kept[row], float(uniform[row]), token)


def test_greedy_rows_take_the_first_maximum(device):
    logits = random_logits(4, 5000, seed=0)
    # ties for the maximum: in one chunk of 4096 tokens, or in two at the same lane
    first, second = torch.tensor([3, 990, 0, 500]), torch.tensor([10, 5, 4096, 4596])
    logits[torch.arange(4), first] = 30.0  # above any random value
    logits[torch.arange(4), second] = 30.0
    args = batch(logits, 0.0, [0, 5, 1, 0], [1.0, 0.5, 0.9, 0.1], [0.1, 0.5, 0.9, 0.99], device)
    result = run_both(args)
    assert torch.equal(result["tokens"], torch.minimum(first, second))
    assert torch.equal(result["tokens"], logits.argmax(dim=1))
    assert torch.equal(result["tokens"], result["twin_tokens"])
    assert torch.equal(result["cutoff"], torch.full((4,), 30.0))


def test_top_k_one_is_the_argmax(device):
    logits = random_logits(4, 1000, seed=1)
    args = batch(
        logits, [0.3, 1.0, 1.7, 5.0], 1, [1.0, 0.5, 0.9, 0.99], [0.0, 0.3, 0.7, 0.999], device
    )
    result = run_both(args)
    assert torch.equal(result["tokens"], logits.argmax(dim=1))
    assert torch.equal(result["kept"].sum(dim=1), torch.ones(4, dtype=torch.long))


# Every combination of top-k (off, small, larger, >= vocab) and top-p (off, tight, loose).
FILTERS = list(itertools.product([0, 3, 40, 5000], [1.0, 0.3, 0.9, 0.995]))


@pytest.mark.parametrize("vocab", [1000, 49_152])
def test_kept_sets_and_tokens_match_twin(device, vocab):
    filters = FILTERS if vocab == 1000 else FILTERS[5::3]  # fewer rows of the long vocab
    rows = len(filters)
    top_k, top_p = (list(column) for column in zip(*filters, strict=True))
    temperature = [(0.5, 1.0, 1.5)[row % 3] for row in range(rows)]
    uniform = torch.rand(rows, generator=torch.Generator().manual_seed(vocab))
    args = batch(random_logits(rows, vocab, seed=vocab), temperature, top_k, top_p, uniform, device)
    result = run_both(args)
    assert_matches_twin(result, args)
    # of distinct values, top-k keeps k; top-p then at most as many
    kept = result["kept"].sum(dim=1)
    for row, (k, p) in enumerate(filters):
        k = k if 0 < k < vocab else vocab
        assert kept[row] == k if p == 1 else kept[row] <= k


@pytest.mark.skipif(not interpreting(), reason="models a GPU's rounding in the interpreter")
def test_kept_sets_match_twin_rounded_as_on_a_gpu(gpu_rounding):
    """With ``/`` and ``exp`` rounded as on a GPU, the kernel keeps the twin's top-k sets exactly
    and its top-p cuts and draws within rounding: ``logits / temperature`` is an IEEE division
    (an approximate one moved the cut of 13 of these 48 rows, the twin's division being exact)."""
    filters = [f for f in FILTERS for _ in range(3)]
    rows = len(filters)
    top_k, top_p = (list(column) for column in zip(*filters, strict=True))
    temperature = [(1.5, 0.8, 0.3)[row % 3] for row in range(rows)]
    uniform = torch.rand(rows, generator=torch.Generator().manual_seed(11))
    args = batch(random_logits(rows, 1000, seed=11), temperature, top_k, top_p, uniform, "cpu")
    result = run_both(args)
    assert_matches_twin(result, args)
    kept = result["kept"].sum(dim=1)
    for row, (k, p) in enumerate(filters):
        k = k if 0 < k < 1000 else 1000
        assert kept[row] == k if p == 1 else kept[row] <= k


def test_kept_sets_match_engine_sampler(device):
    """With no ties (random floats), the kept sets are those ``engine/sample/sampler.py`` keeps."""
    rows = len(FILTERS)
    top_k, top_p = (torch.tensor(column) for column in zip(*FILTERS, strict=True))
    args = batch(random_logits(rows, 1000, seed=5), 0.8, top_k, top_p, 0.5, device)
    result = run_both(args)
    # The sampler's float32 running sum of probabilities can reach 1.0 before the row's end and
    # then drop the tail at top_p = 1 (tokens of ~1e-7 each); a top_p above 1 turns its cut off.
    engine = _apply_top_k_top_p(result["s"], top_k, torch.where(top_p < 1, top_p, 2.0)) > NEG_INF
    for row in (result["kept"] != engine).any(dim=1).nonzero().flatten().tolist():
        top_k, top_p = FILTERS[row]
        assert top_p < 1, f"row {row}: top-k alone keeps exactly the sampler's set"
        # a top-p cut within rounding of its target (both sides sum in float32)
        for kept in (result["kept"][row], engine[row]):
            assert_top_p_cut_within_rounding(result["s"][row], kept, top_k, top_p)


def test_ties_at_the_cut_are_all_kept(device):
    # integer logits: hundreds of tokens share each value
    generator = torch.Generator().manual_seed(6)
    logits = torch.randint(0, 12, (6, 1000), generator=generator).float()
    args = batch(logits, 1.0, [1, 3, 50, 0, 0, 50], [1.0, 1.0, 1.0, 0.3, 0.9, 0.5], 0.25, device)
    result = run_both(args)
    assert torch.equal(result["kept"], result["twin_kept"])  # cuts far from any rounding
    assert_matches_twin(result, args)  # draws (ties of weight 1 are exact, others may round)
    s, cutoff = result["s"], result["cutoff"].unsqueeze(1)
    assert torch.equal(cutoff.squeeze(1)[:3], s[:3].max(dim=1).values)  # k <= ties at the top
    above, at_or_above = (s > cutoff).sum(dim=1), (s >= cutoff).sum(dim=1)
    assert (above[:3] < torch.tensor([1, 3, 50])).all()
    assert (at_or_above[:3] >= torch.tensor([1, 3, 50])).all()
    assert (at_or_above > above).all()  # the whole tie at the cut


def test_masked_tokens_are_never_drawn(device):
    logits = torch.full((6, 700), NEG_INF)
    allowed = torch.tensor([5, 64, 65, 300, 699])
    logits[:, allowed] = torch.tensor([1.0, 3.0, 0.5, 2.0, 1.5])
    uniform = [0.0, 0.5, 0.999_999_9, 0.0, 0.999_999_9, 0.7]
    args = batch(
        logits, 1.0, [0, 0, 0, 10, 10, 3], [1.0, 1.0, 1.0, 1.0, 0.99, 0.9], uniform, device
    )
    result = run_both(args)
    assert_matches_twin(result, args)
    assert torch.isin(result["tokens"], allowed).all()
    assert result["tokens"][0] == 5 and result["tokens"][2] == 699  # first and last allowed


def test_draws_follow_the_kept_probabilities(device):
    """One row, evenly spaced uniforms: each kept token is drawn in proportion to its
    renormalised probability (within one draw: inverse transform over a partition of [0, 1)),
    and the total variation distance is below 0.02. The interpreter draws 150 times (at most 5
    tokens are kept, so the bound holds by construction), CUDA 2000 times."""
    draws = 2000 if device.type == "cuda" else 150
    logits = random_logits(1, 1000, seed=7).expand(draws, -1)
    uniform = (torch.arange(draws) + 0.5) / draws
    args = batch(logits, 0.9, 5, 0.95, uniform, device)
    result = run_both(args)
    kept = result["twin_kept"][0]
    weights = (result["s"][0] - result["s"][0].max()).double().exp() * kept
    expected = weights / weights.sum()
    counts = torch.bincount(result["tokens"], minlength=1000).double()
    assert counts[~kept].sum() == 0
    assert ((counts - draws * expected).abs() <= 1).all()
    assert 0.5 * (counts / draws - expected).abs().sum() < 0.02
    assert_matches_twin(result, args)


def test_layout_contract_errors_name_the_argument(device):
    args = batch(random_logits(2, 100, seed=8), 1.0, 0, 1.0, 0.5, device)
    logits, temperature, top_k, top_p, uniform = args
    with pytest.raises(ValueError, match="^logits has dtype"):
        sample(logits.half(), temperature, top_k, top_p, uniform)
    with pytest.raises(ValueError, match="^logits' last dimension is not contiguous"):
        sample(logits.t().contiguous().t(), temperature, top_k, top_p, uniform)
    with pytest.raises(ValueError, match="^top_k has dtype"):
        sample(logits, temperature, top_k.float(), top_p, uniform)
    with pytest.raises(ValueError, match="^uniform has shape"):
        sample(logits, temperature, top_k, top_p, uniform[:1])
    with pytest.raises(ValueError, match="^temperature is on meta"):
        sample(logits, temperature.to("meta"), top_k, top_p, uniform)
    with pytest.raises(ValueError, match="^out has dtype"):
        sample(logits, temperature, top_k, top_p, uniform, out=top_k)


def test_compiled_for_a_gpu_every_division_is_exact(tmp_path):
    """Compiled for an H100/H200 (sm_90, no GPU needed), the kernel divides with IEEE division
    (``div.rn.f32``) only, never the approximate ``div.full.f32`` Triton makes of a float32 ``/``
    (the interpreter divides exactly either way)."""
    pointers = ("logits", "temperature", "top_k", "top_p", "uniform", "out", "cutoff")
    types = ("*fp32", "*fp32", "*i32", "*fp32", "*fp32", "*i64", "*fp32")
    signature = {f"{name}_ptr": kind for name, kind in zip(pointers, types, strict=True)}
    signature.update(vocab="i32", row_stride="i32", BLOCK="constexpr")
    ptx = compiled_ptx(
        "llmrpc.kernels.triton_sampling", "_sample_kernel", signature, {"BLOCK": 4096}, tmp_path,
        num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    assert "div.rn.f32" in ptx
    assert "div.full.f32" not in ptx and "div.approx.f32" not in ptx
