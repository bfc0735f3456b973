"""Token sampling: greedy, temperature, top-k, top-p, min-p, with one RNG per request.

Each request draws from its own ``torch.Generator`` (seeded from the request's ``seed``, or from
the engine's seed), so a seeded request picks the same tokens alone or inside any batch.
"""

from __future__ import annotations

import torch

from llmrpc.engine.request import Request


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [num_requests, vocab_size] float32
        requests: list[Request],
        generators: list[torch.Generator],
    ) -> list[int]:
        _mask_early_stops(logits, requests)
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            probs = _probabilities(logits[rows], [requests[i] for i in sampled_rows])
            for probs_row, i in zip(probs, sampled_rows, strict=True):
                # Exponential race: argmax(p / q), q ~ Exp(1), picks token t with probability p_t.
                q = torch.empty_like(probs_row).exponential_(generator=generators[i])
                tokens[i] = (probs_row / q).argmax()
        return tokens.tolist()


def _mask_early_stops(logits: torch.Tensor, requests: list[Request]) -> None:
    """Below ``min_tokens``, EOS and stop tokens cannot be picked."""
    for i, request in enumerate(requests):
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            continue
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= request.eos_token_ids
        if stops:
            logits[i, sorted(stops)] = float("-inf")


def _probabilities(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    temperature = torch.tensor([r.params.temperature for r in requests]).unsqueeze(1)
    logits = logits / temperature
    top_k = torch.tensor([r.params.top_k for r in requests])
    top_p = torch.tensor([r.params.top_p for r in requests])
    if bool((top_k > 0).any() or (top_p < 1).any()):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([r.params.min_p for r in requests]).unsqueeze(1)
    if bool((min_p > 0).any()):
        keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
        probs = (probs * keep).div(probs.mul(keep).sum(-1, keepdim=True))
    return probs  # [num_requests, vocab_size]


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[-1]
    ranks = torch.arange(vocab_size).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab_size).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the tokens before it already cover top_p; the first always stays.
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
