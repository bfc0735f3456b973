"""Per-request logits rules applied before sampling, with vLLM's semantics.

Order: the hard constraints (allowed tokens, bad words), min_tokens, logit bias, then penalties.
Each works in place on a ``[num_requests, vocab_size]`` float32 tensor and skips the requests
that do not use it. Per step, each rule costs the vocabulary row or less, never the length of the
list the client gave: tensors are built once per request, bad words are followed through an
automaton (engine/matching.py).
"""

from __future__ import annotations

import torch

from llmrpc.engine.request import Request

NEG_INF = float("-inf")


def apply_logits_processors(
    logits: torch.Tensor, requests: list[Request]
) -> list[torch.Tensor | None]:
    """Apply every request's rules to its row; returns per row the ``[vocab_size]`` mask of the
    tokens its hard constraints permit (None: every token), for the sampler to enforce."""
    permitted = []
    for row, request in enumerate(requests):
        params = request.params
        permitted.append(_apply_hard_constraints(logits[row], request))
        if request.num_output_tokens < params.min_tokens:
            _mask_stop_tokens(logits[row], request)
        if params.logit_bias:
            ids = _cached(request, "bias_ids", logits[row], _bias_ids)
            values = _cached(request, "bias_values", logits[row], _bias_values)
            logits[row].index_add_(0, ids, values)
        if params.has_penalties:
            _apply_penalties(logits[row], request)
    return permitted


def _apply_hard_constraints(row: torch.Tensor, request: Request) -> torch.Tensor | None:
    """Allowed tokens and bad words as one mask. Should the bad words ban every allowed token,
    the allowed tokens win: the sampler must return some token, and only they are certain."""
    allowed = request.params.allowed_token_ids
    banned = _banned_tokens(request)
    if allowed is None and not banned:
        return None
    vocab_size = row.shape[0]
    if allowed is None:
        mask = torch.ones(vocab_size, dtype=torch.bool, device=row.device)
        keeps_some = len(set(banned)) < vocab_size
    else:
        mask = _cached(request, "allowed_mask", row, _allowed_mask)
        allowed_set = _cached(request, "allowed_set", row, _allowed_set)
        keeps_some = len(allowed_set & set(banned)) < len(allowed_set)  # O(len(banned))
    if banned and keeps_some:
        mask = mask.clone()
        mask[banned] = False
    row.masked_fill_(~mask, NEG_INF)
    return mask


def _banned_tokens(request: Request) -> list[int]:
    """The last token of each bad word whose other tokens the output just produced."""
    if request.bad_words is None:
        return []
    return request.bad_words.completions(request.output_token_ids)


def _cached(request: Request, name: str, row: torch.Tensor, build):
    """``request.params_cache[name]``: ``build(request, vocab_size)`` on first use; a tensor is
    moved to the row's device once."""
    value = request.params_cache.get(name)
    if value is None:
        value = build(request, row.shape[0])
    if isinstance(value, torch.Tensor) and value.device != row.device:
        value = value.to(row.device)
    request.params_cache[name] = value
    return value


def _allowed_mask(request: Request, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[request.params.allowed_token_ids] = True
    return mask


def _allowed_set(request: Request, vocab_size: int) -> frozenset[int]:
    return frozenset(request.params.allowed_token_ids)


def _bias_ids(request: Request, vocab_size: int) -> torch.Tensor:
    return torch.tensor(list(request.params.logit_bias), dtype=torch.long)


def _bias_values(request: Request, vocab_size: int) -> torch.Tensor:
    return torch.tensor(list(request.params.logit_bias.values()), dtype=torch.float32)


def _mask_stop_tokens(row: torch.Tensor, request: Request) -> None:
    """Below ``min_tokens``, EOS and stop tokens cannot be picked."""
    stops = _cached(request, "min_tokens_stops", row, _stop_ids)
    if stops.numel():
        row[stops] = NEG_INF


def _stop_ids(request: Request, vocab_size: int) -> torch.Tensor:
    stops = set(request.params.stop_token_ids)
    if not request.params.ignore_eos:
        stops |= request.eos_token_ids
    return torch.tensor(sorted(stops), dtype=torch.long)


def _apply_penalties(row: torch.Tensor, request: Request) -> None:
    params = request.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long)
        values = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if request.output_counts and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(list(request.output_counts), dtype=torch.long)
        counts = torch.tensor(list(request.output_counts.values()), dtype=row.dtype)
        row.index_add_(0, ids, -(params.frequency_penalty * counts + params.presence_penalty))
