"""The Triton sampling kernel against its twin ``sample_torch`` and against the kept sets of
``engine/sampler.py``: in Triton's interpreter on the CPU (conftest sets ``TRITON_INTERPRET=1``
without a GPU), and the same tests natively on CUDA under the ``gpu`` mark.

Kernel and twin select the same top-k sets exactly. A top-p cut or a draw may differ by one token
where a running weight lands within float32 rounding of its target (the kernel sums in float32,
the twin in float64); the tests allow one such row per batch and require the tokens it moves to
carry almost no probability. On the seeds here, in the interpreter, there is none; of 1,500
random rows of 1,000 logits one top-p cut differed, of 40 rows of 49,152 one, and no token.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from kernel_devices import DEVICES

from llmrpc.engine.sampler import _apply_top_k_top_p
from llmrpc.kernels.triton_sampling import kept_cutoff_torch, sample, sample_torch

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


def assert_matches_twin(result, top_p: torch.Tensor) -> None:
    """Same kept sets and tokens, but for at most one row whose top-p cut or draw fell within
    rounding of a boundary: there the tokens kept by one side only weigh < 1e-5 of the row."""
    kept, twin_kept = result["kept"], result["twin_kept"]
    differing = (kept != twin_kept).any(dim=1)
    # both cuts are the least kept value
    assert torch.equal(result["cutoff"][~differing], result["twin_cutoff"][~differing])
    for row in differing.nonzero().flatten().tolist():
        assert top_p[row] < 1, "top-k alone must select exactly the twin's set"
        weight = (result["s"][row] - result["s"][row].max()).double().exp()
        assert weight[kept[row] != twin_kept[row]].sum() < 1e-5 * weight[twin_kept[row]].sum()
    moved = (result["tokens"] != result["twin_tokens"]).sum()
    assert differing.sum() + moved <= 1


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
    assert_matches_twin(result, args[3].cpu())
    # of distinct values, top-k keeps k; top-p then at most as many
    kept = result["kept"].sum(dim=1)
    for row, (k, p) in enumerate(filters):
        k = k if 0 < k < vocab else vocab
        assert kept[row] == k if p == 1 else kept[row] <= k


def test_kept_sets_match_engine_sampler(device):
    """With no ties (random floats), the kept sets are those ``engine/sampler.py`` keeps."""
    rows = len(FILTERS)
    top_k, top_p = (torch.tensor(column) for column in zip(*FILTERS, strict=True))
    args = batch(random_logits(rows, 1000, seed=5), 0.8, top_k, top_p, 0.5, device)
    result = run_both(args)
    # The sampler's float32 running sum of probabilities can reach 1.0 before the row's end and
    # then drop the tail at top_p = 1 (tokens of ~1e-7 each); a top_p above 1 turns its cut off.
    engine = _apply_top_k_top_p(result["s"], top_k, torch.where(top_p < 1, top_p, 2.0))
    assert torch.equal(result["kept"], engine > NEG_INF)


def test_ties_at_the_cut_are_all_kept(device):
    # integer logits: hundreds of tokens share each value
    generator = torch.Generator().manual_seed(6)
    logits = torch.randint(0, 12, (6, 1000), generator=generator).float()
    args = batch(logits, 1.0, [1, 3, 50, 0, 0, 50], [1.0, 1.0, 1.0, 0.3, 0.9, 0.5], 0.25, device)
    result = run_both(args)
    assert torch.equal(result["cutoff"], result["twin_cutoff"])
    assert torch.equal(result["tokens"], result["twin_tokens"])
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
    assert torch.equal(result["tokens"], result["twin_tokens"])
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
    assert torch.equal(result["tokens"], result["twin_tokens"])


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
