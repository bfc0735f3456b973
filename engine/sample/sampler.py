"""Token sampling: greedy, temperature, top-k, top-p, min-p, with one RNG per request.

Each request draws from its own ``torch.Generator`` (seeded from the request's ``seed``, or from
the engine's seed), so a seeded request draws the same numbers alone or inside any batch (and
picks the same tokens where its logits are the same too: ``--batch-invariant``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmrpc.engine.request import Request, TokenLogprobs
from llmrpc.engine.sample.logits_processors import NEG_INF, HardConstraints, apply_logits_processors
from llmrpc.kernels import cpu_ops

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per request, when it asked for them


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs", backend: str = "torch") -> None:
        """``backend`` "triton": rows that sample (without min_p) are filtered and drawn by
        ``kernel_ops/triton_sampling.py`` (top-k/top-p cuts by bisection, the draw in vocabulary
        order), not by the sort below; a seed then picks its tokens by that kernel's rule."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}")
        self.logprobs_mode = logprobs_mode
        self.backend = backend

    def __call__(
        self,
        logits: torch.Tensor,  # [num_requests, vocab_size] float32, modified in place
        requests: list[Request],
        generators: list[torch.Generator],
    ) -> SamplerOutput:
        if not requests:  # a step of prompt chunks only: nothing to sample, nothing to sync
            return SamplerOutput([], [])
        wants_logprobs = any(r.params.logprobs is not None for r in requests)
        raw = logits.clone() if wants_logprobs and self.logprobs_mode.startswith("raw") else None
        constraints = apply_logits_processors(logits, requests)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        kernel_generators = None
        if self.backend == "triton" and not any(requests[i].params.min_p for i in sampled):
            kernel_generators = [generators[i] for i in sampled]
        processed, drawn = _process(logits, requests, kernel_generators)
        # A row whose best value is not finite (NaN, +inf, or nothing left above -inf) cannot
        # be sampled as it is; it is marked -1 here and repaired below, without a second sync.
        best, tokens = row_max(processed)
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            if drawn is None:
                drawn = _draw(processed[rows], [generators[i] for i in sampled])
            tokens[rows] = drawn
        token_ids = torch.where(best.isfinite(), tokens, -1).tolist()
        for i, token_id in enumerate(token_ids):
            if token_id < 0:
                token_ids[i] = _repair(processed, i, constraints[i], requests[i], generators[i])
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if wants_logprobs:
            values = self.logprob_values(raw if raw is not None else processed)
            for i, request in enumerate(requests):
                if request.params.logprobs is not None:
                    logprobs[i] = token_logprobs(values[i], token_ids[i], request.params.logprobs)
        return SamplerOutput(token_ids, logprobs)

    def logprob_values(self, logits: torch.Tensor) -> torch.Tensor:
        """What ``--logprobs-mode`` reports: log-softmax of the logits, or the logits."""
        if self.logprobs_mode.endswith("logprobs"):
            return logits.log_softmax(dim=-1)
        return logits


def token_logprobs(values: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """Logprob (or logit) and rank of ``token_id`` in ``values`` ``[vocab_size]``; the top N."""
    chosen = values[token_id]
    rank = int((values > chosen).sum()) + 1
    top_values, top_ids = values.topk(num_top) if num_top else (values[:0], values[:0].long())
    top = list(zip(top_ids.tolist(), top_values.tolist(), strict=True))
    return TokenLogprobs(token_id, float(chosen), rank, top)


def row_max(values: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``values.max(dim=-1)`` (values, and the first index of each row's maximum) for
    ``[rows, vocab]``. torch's max with indices walks a long row one element at a time (2.3 ms
    for 32 rows of 49152 on one thread). On the CPU the C++ kernel takes float32 rows (one row of
    49152: 11-13 us); elsewhere ``chunked_row_max``. A row with NaN has a NaN maximum and an index
    out of range, as a row the caller must repair anyway."""
    rows, width = values.shape
    if rows == 0:  # a step whose logits are all prompt logprobs: nothing samples
        return values.new_empty(0), values.new_empty(0, dtype=torch.long)
    if (
        values.device.type == "cpu"
        and values.dtype == torch.float32
        and values.is_contiguous()
        and cpu_ops.loaded()
    ):
        return torch.ops.llmrpc_cpu.row_max.default(values)
    return chunked_row_max(values, chunk)


def chunked_row_max(values: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_max`` by torch's operations: a vectorized max per chunk, then the first chunk
    holding the row's maximum, then the first position in it (32 rows of 49152: 0.37 ms)."""
    rows, width = values.shape
    pad = -width % chunk
    if pad:
        values = torch.nn.functional.pad(values, (0, pad), value=NEG_INF)
    blocks = values.view(rows, -1, chunk)
    chunk_max = blocks.amax(dim=-1)  # [rows, num_chunks]
    best = chunk_max.amax(dim=-1, keepdim=True)
    num_chunks = chunk_max.shape[1]
    first_chunk = _first_true(chunk_max == best, num_chunks).clamp_(max=num_chunks - 1)
    inside = _first_true(
        blocks[torch.arange(rows, device=values.device), first_chunk] == best, chunk
    )
    return best.squeeze(1), first_chunk * chunk + inside


def _first_true(mask: torch.Tensor, width: int) -> torch.Tensor:
    """Index of the first True of each row of ``mask`` (``width`` where there is none)."""
    return torch.where(mask, torch.arange(width, device=mask.device), width).amin(dim=-1)


def _uniforms(generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    """One uniform draw per row from the row's own generator, on the host (a seed draws the
    same on every device), then moved to ``device`` (``[rows]`` float32)."""
    return torch.cat([torch.rand(1, generator=g) for g in generators]).to(device)


def _draw(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row by inverse transform: the first whose cumulative probability passes a
    uniform draw from the row's own generator. Tokens of probability 0 are never picked."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)  # [num_rows, vocab_size]
    uniform = _uniforms(generators, logits.device).unsqueeze(1)
    tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    return tokens.clamp_(max=logits.shape[-1] - 1)


def _repair(
    processed: torch.Tensor,
    row: int,
    constraints: HardConstraints | None,
    request: Request,
    generator: torch.Generator,
) -> int:
    """A token for a row the parameters broke, still within its hard constraints: tokens at
    +inf share the choice; NaN counts as -inf; if nothing is left, every permitted token is
    equally likely. The repaired row replaces the broken one (its logprobs are then defined)."""
    values = processed[row].nan_to_num(nan=NEG_INF, posinf=math.inf)
    if constraints is None:
        permitted = torch.ones_like(values, dtype=torch.bool)
    else:
        permitted = constraints.permitted(values)
    values = values.masked_fill(~permitted, NEG_INF)
    if bool(values.isposinf().any()):
        candidates = values.isposinf()
    elif bool((values > NEG_INF).any()):
        candidates = None  # finite values remain: sample them as they are
    else:
        candidates = permitted
    if candidates is not None:
        values = torch.zeros_like(values).masked_fill(~candidates, NEG_INF)
    processed[row] = values
    if request.params.greedy:
        return int(values.argmax())
    return int(_draw(values.unsqueeze(0), [generator])[0])


def _processed_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to the rows that sample."""
    return _process(logits, requests)[0]


def _process(
    logits: torch.Tensor,
    requests: list[Request],
    kernel_generators: list[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_processed_logits``, and with ``kernel_generators`` (those of the rows that sample,
    none of which has min_p) the Triton sampling kernel's cut and tokens for those rows: their
    processed logits are then the scaled ones with what its top-k/top-p cut dropped at -inf."""
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not sampled:
        return logits, None
    every_row = len(sampled) == len(requests)
    device = logits.device
    rows = torch.tensor(sampled, device=device)
    params = [requests[i].params for i in sampled]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = (logits if every_row else logits[rows]) / temperature.unsqueeze(1)
    drawn = None
    if kernel_generators is not None:
        from llmrpc.kernels import triton_sampling

        cutoff = torch.empty(len(sampled), device=device)
        drawn = triton_sampling.sample(
            scaled,
            torch.ones_like(temperature),  # already scaled: the kernel divides by 1, exactly
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device),
            _uniforms(kernel_generators, device),
            cutoff_out=cutoff,
        )
        scaled = scaled.masked_fill(scaled < cutoff.unsqueeze(1), NEG_INF)
    elif any(p.top_k > 0 or p.top_p < 1 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    min_p = [p.min_p for p in params]
    if any(min_p):
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
        floor = [math.log(m) if m > 0 else NEG_INF for m in min_p]
        floor = torch.tensor(floor, device=device).unsqueeze(1)
        scaled = scaled.masked_fill(scaled < scaled.max(-1, keepdim=True).values + floor, NEG_INF)
    if every_row:
        return scaled, drawn
    logits = logits.clone()
    logits[rows] = scaled
    return logits, drawn


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[-1]
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab_size).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, NEG_INF)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the tokens before it already cover top_p; the first always stays. A row
    # with top_p >= 1 drops nothing: its float32 running sum can round up to 1 before the tail.
    covered = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
    drop = covered & (top_p < 1).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter(-1, order, sorted_logits)
