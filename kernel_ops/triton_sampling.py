"""Token sampling on the device in one Triton kernel: greedy, temperature, top-k, top-p, and a
draw by inverse transform, with no host synchronisation (the kernel and its wrapper never read a
value back); ``sample_torch`` is its twin.

Semantics, per row of ``logits`` ``[rows, vocab]`` (float32; at least one finite value per row,
no NaN or +inf), for its ``temperature``, ``top_k``, ``top_p`` and ``uniform`` in [0, 1):

* ``temperature <= 0``: greedy, the first index of the row's maximum logit.
* Otherwise ``s = logits / temperature`` (float32 division, correctly rounded: ``tl.div_rn``,
  as torch divides; Triton lowers ``/`` to an approximate division on NVIDIA GPUs, which would
  move ``s`` by an ulp and so the cut) and token weights ``w = exp(s - max(s))``, so
  probabilities ``p = w / sum(w)`` (softmax in float32).
* top-k (on where ``0 < top_k < vocab``): the kept set is ``s >= t_k``, ``t_k`` the ``top_k``-th
  largest ``s`` counting repeats; every token tied with ``t_k`` stays, so it may hold more than
  ``top_k`` tokens. Off: ``t_k = min(s)``.
* top-p (on where ``top_p < 1``), on the top-k survivors with their renormalised probabilities:
  the kept set is ``s >= t_p``, ``t_p`` the largest value ``v`` such that the weights of the
  survivors with ``s >= v`` reach ``top_p`` times the survivors' total. This is the smallest set
  of most probable tokens whose mass reaches ``top_p``, with every token tied at the cut (so the
  most probable token always stays), as ``engine/sample/sampler.py`` keeps it ("drop a token once
  the tokens before it cover top_p") where there are no ties. Off: ``t_p = t_k``.
* The draw: the first token in vocabulary order whose cumulative kept weight exceeds
  ``uniform * (total kept weight)``. Tokens of weight 0 are never drawn.

The thresholds are found without a sort, by bisection over the float32 values' order-preserving
int32 keys: the largest key whose count (top-k) or weight (top-p) of tokens at or above it still
reaches the target. Each step is one pass over the row and halves a gap of at most 2**32 keys,
so it ends exactly after at most 32 steps (fewer where the row's values lie close together; the
loop runs on the device). A row takes two passes, at most 32 more per filter that is on, and one
for the draw. One program per row walks it in chunks of ``CHUNK`` tokens.

Kernel and twin select the same top-k set exactly, on every device: both compare the same
``s``. Their weights and weight sums are rounded differently (the kernel's ``exp`` is approximate
on a GPU and it sums in float32 chunk by chunk, the twin in float64 in sorted or vocabulary
order), so at a top-p cut or a draw that falls within rounding (about 1e-7 of the total, more on
long rows) of a boundary they may disagree by one token; on random rows that is rare, and the
tests accept it only there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmrpc.kernels.triton_utils import check, check_device

# Tokens per chunk of a row: each pass walks the row in chunks of this many.
CHUNK = 4096


@triton.jit
def _key(s):
    """An int32 key per float32 ``s`` ordered as the values are: ``a < b`` <=> ``key(a) <
    key(b)``, -0.0 and 0.0 sharing 0 (negative floats' magnitude bits are flipped), as int64."""
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(s == 0.0, 0, key).to(tl.int64)


@triton.jit
def _value(key):
    """The float32 whose ``_key`` is ``key`` (within the int32 range): ``s >= _value(key)``
    <=> ``_key(s) >= key``, so passes compare values and never key the row."""
    key = key.to(tl.int32)
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _kept_weight(row_ptr, cols, vocab, temperature, s_max, bound, BLOCK: tl.constexpr):
    """Total weight ``exp(s - s_max)`` of the row's tokens with ``s >= bound``."""
    total = tl.full([BLOCK], 0, tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        valid = idx < vocab
        s = tl.div_rn(tl.load(row_ptr + idx, mask=valid, other=float("-inf")), temperature)
        total += tl.where(valid & (s >= bound), tl.exp(s - s_max), 0.0)
    return tl.sum(total, axis=0)


@triton.jit
def _bisect(
    row_ptr,
    cols,
    vocab,
    temperature,
    s_max,
    lo,
    lo_measure,
    hi,
    target,
    WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The largest key in ``[lo, hi)`` whose tokens at or above it measure at least ``target``
    (their count, or with ``WEIGHTED`` their weight), and that measure; ``lo`` must reach the
    target (measuring ``lo_measure``), ``hi`` must not. Each step halves the gap, which is at
    most 2**32 keys: at most 32 steps, fewer where the row's values lie close together."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        bits = mid.to(tl.int32)  # _value(mid), inline: each jit call costs the interpreter a lot
        bound = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)
        measure = tl.full([BLOCK], 0, tl.float32)  # counts are exact in float32 up to 2**24
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            valid = idx < vocab
            s = tl.div_rn(tl.load(row_ptr + idx, mask=valid, other=float("-inf")), temperature)
            if WEIGHTED:
                measure += tl.where(valid & (s >= bound), tl.exp(s - s_max), 0.0)
            else:
                measure += (valid & (s >= bound)).to(tl.float32)
        total = tl.sum(measure, axis=0)
        reached = total >= target
        lo = tl.where(reached, mid, lo)
        lo_measure = tl.where(reached, total, lo_measure)
        hi = tl.where(reached, hi, mid)
    return lo, lo_measure


@triton.jit
def _sample_kernel(
    logits_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    uniform_ptr,
    out_ptr,
    cutoff_ptr,
    vocab,
    row_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    given_temperature = tl.load(temperature_ptr + row)
    temperature = tl.where(given_temperature > 0, given_temperature, 1.0)  # greedy: s = logits

    # The row's minimum and maximum of s, and the maximum's first index (per lane, then across
    # lanes).
    lane_min = tl.full([BLOCK], float("inf"), tl.float32)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_arg = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        valid = idx < vocab
        s = tl.div_rn(tl.load(row_ptr + idx, mask=valid, other=float("-inf")), temperature)
        better = s > lane_max  # strict: a lane keeps its first maximum
        lane_arg = tl.where(better, idx, lane_arg)
        lane_max = tl.where(better, s, lane_max)
        lane_min = tl.minimum(lane_min, tl.where(valid, s, float("inf")))
    s_max = tl.max(lane_max, axis=0)
    token = tl.min(tl.where(lane_max == s_max, lane_arg, vocab), axis=0).to(tl.int64)
    cutoff = s_max

    if given_temperature > 0:
        # The cut, as a key: every token at first; no key reaches above the maximum's.
        cut = _key(tl.min(lane_min, axis=0))
        above_max = _key(s_max) + 1
        top_k = tl.load(top_k_ptr + row)
        if (top_k > 0) & (top_k < vocab):
            cut, _ = _bisect(
                row_ptr, cols, vocab, temperature, s_max, cut, vocab * 1.0, above_max,
                top_k.to(tl.float32), False, BLOCK,
            )  # fmt: skip
        kept_total = _kept_weight(row_ptr, cols, vocab, temperature, s_max, _value(cut), BLOCK)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            cut, kept_total = _bisect(
                row_ptr, cols, vocab, temperature, s_max, cut, kept_total, above_max,
                top_p * kept_total, True, BLOCK,
            )  # fmt: skip
        cutoff = _value(cut)

        # The draw: the first token whose running kept weight exceeds uniform * total. The
        # running weight never decreases (each chunk goes on from the last one's end), so that
        # token's index is the number of tokens whose running weight does not exceed it. Should
        # rounding leave none above it (uniform near 1), the last token of positive weight.
        target = tl.load(uniform_ptr + row) * kept_total
        carry = tl.full([], 0.0, tl.float32)
        below = tl.full([BLOCK], 0, tl.int32)
        lane_last = tl.full([BLOCK], -1, tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            valid = idx < vocab
            s = tl.div_rn(tl.load(row_ptr + idx, mask=valid, other=float("-inf")), temperature)
            w = tl.where(valid & (s >= cutoff), tl.exp(s - s_max), 0.0)
            running = carry + tl.cumsum(w, axis=0)
            below += (valid & (running <= target)).to(tl.int32)
            lane_last = tl.where(w > 0, idx, lane_last)
            carry = tl.max(running, axis=0)
        drawn = tl.sum(below, axis=0)
        token = tl.where(drawn < vocab, drawn, tl.max(lane_last, axis=0)).to(tl.int64)

    tl.store(out_ptr + row, token)
    tl.store(cutoff_ptr + row, cutoff)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    cutoff_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[rows, vocab]`` float32 (last dimension contiguous)
    as the module docstring defines it, for ``temperature``, ``top_p``, ``uniform`` ``[rows]``
    float32 and ``top_k`` ``[rows]`` int32 or int64, all on the logits' device. Returns ``out``
    (``[rows]`` int64, new where not given). ``cutoff_out`` (``[rows]`` float32), where given,
    receives each row's cut: the kept tokens are those with ``logits / temperature >= cutoff``
    (a greedy row's: its maximum logit)."""
    device = logits.device
    check(logits.dim() == 2, f"logits has shape {tuple(logits.shape)}, expected 2-D")
    check(logits.dtype == torch.float32, f"logits has dtype {logits.dtype}, expected float32")
    rows, vocab = logits.shape
    # (counts are summed in float32, exact up to 2**24)
    check(0 < vocab <= 2**24, f"logits has {vocab} columns, expected 1 to 2**24")
    check(logits.stride(1) == 1 or vocab == 1, "logits' last dimension is not contiguous")
    check_device("logits", logits, device)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=device)
    if cutoff_out is None:
        cutoff_out = torch.empty(rows, dtype=torch.float32, device=device)
    for name, t, dtypes in (
        ("temperature", temperature, (torch.float32,)),
        ("top_k", top_k, (torch.int32, torch.int64)),
        ("top_p", top_p, (torch.float32,)),
        ("uniform", uniform, (torch.float32,)),
        ("out", out, (torch.int64,)),
        ("cutoff_out", cutoff_out, (torch.float32,)),
    ):
        check(t.shape == (rows,), f"{name} has shape {tuple(t.shape)}, expected ({rows},)")
        check(t.dtype in dtypes, f"{name} has dtype {t.dtype}, expected {dtypes[0]}")
        check(t.is_contiguous(), f"{name} is not contiguous")
        check_device(name, t, device)
    if rows:
        _sample_kernel[(rows,)](
            logits,
            temperature,
            top_k,
            top_p,
            uniform,
            out,
            cutoff_out,
            vocab,
            logits.stride(0),
            BLOCK=min(CHUNK, triton.next_power_of_2(vocab)),
            num_warps=8,
            enable_fp_fusion=False,
        )
    return out


def kept_cutoff_torch(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Each row's cut as ``sample``'s ``cutoff_out`` gives it, found by a sort: the kept tokens
    are those with ``s >= cutoff``. t_k is the top_k-th sorted value; t_p the sorted value at the
    first rank whose running weight (float64) reaches top_p times the survivors' total: every
    value above it has less weight at or above it, so it is the largest that reaches."""
    greedy = temperature <= 0
    s = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    vocab = s.shape[1]
    ordered = s.sort(dim=-1, descending=True).values
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    cut_k = ordered.gather(1, (k - 1).unsqueeze(1))
    weight = torch.exp(ordered - ordered[:, :1]).double() * (ordered >= cut_k)
    running = weight.cumsum(dim=-1)
    reached = top_p.double().unsqueeze(1) * running[:, -1:]
    rank = (running < reached).sum(dim=-1, keepdim=True).clamp_(max=vocab - 1)
    cut = torch.where(top_p.unsqueeze(1) < 1, ordered.gather(1, rank), cut_k).squeeze(1)
    return torch.where(greedy, ordered[:, 0], cut)


def sample_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """``sample``'s twin: the same tokens, by a sort and float64 running sums."""
    greedy = temperature <= 0
    s = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    cutoff = kept_cutoff_torch(logits, temperature, top_k, top_p).unsqueeze(1)
    weight = torch.exp(s - s.amax(dim=-1, keepdim=True)).double() * (s >= cutoff)
    running = weight.cumsum(dim=-1)
    drawn = torch.searchsorted(running, uniform.double().unsqueeze(1) * running[:, -1:], right=True)
    drawn = drawn.squeeze(1).clamp_(max=logits.shape[1] - 1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)
