"""Per-request logits rules applied before sampling, with vLLM's semantics.

Order: the hard constraints (structured output, allowed tokens, bad words), min_tokens, logit bias,
then penalties. Each works in place on a ``[num_requests, vocab_size]`` float32 tensor and skips the
requests that do not use it. Per step, each rule costs the vocabulary row or less, never the length
of the list the client gave: tensors are built once per request, bad words are followed through an
automaton (engine/matching.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmrpc.engine.request import Request

NEG_INF = float("-inf")


@dataclass
class HardConstraints:
    """What one row's hard constraints left permitted at this step, kept for the sampler: it
    needs the mask only to repair a row that the other parameters broke (rare), so the mask is
    built then."""

    allowed_mask: torch.Tensor | None  # [vocab_size] bool; None: every token
    banned: list[int]  # bad-word tokens banned at this step
    grammar_mask: torch.Tensor | None = None  # [vocab_size] bool: what structured output allows

    def permitted(self, like: torch.Tensor) -> torch.Tensor:
        if self.allowed_mask is None:
            mask = torch.ones_like(like, dtype=torch.bool)
        else:
            mask = self.allowed_mask.clone()
        mask[self.banned] = False
        if self.grammar_mask is not None:
            both = mask & self.grammar_mask
            # the grammar wins: a token outside it would end the request with an error
            mask = both if bool(both.any()) else self.grammar_mask.clone()
        return mask


def apply_logits_processors(
    logits: torch.Tensor, requests: list[Request]
) -> list[HardConstraints | None]:
    """Apply every request's rules to its row; returns per row its hard constraints (None:
    none), for the sampler to enforce whatever the rest did to the row."""
    constraints = []
    for row, request in enumerate(requests):
        params = request.params
        constraints.append(_apply_hard_constraints(logits[row], request))
        if request.num_output_tokens < params.min_tokens:
            _mask_stop_tokens(logits[row], request)
        if params.logit_bias:
            ids = _cached(request, "bias_ids", logits[row], _bias_ids)
            values = _cached(request, "bias_values", logits[row], _bias_values)
            logits[row].index_add_(0, ids, values)
        if params.has_penalties:
            _apply_penalties(logits[row], request)
    return constraints


def _apply_hard_constraints(row: torch.Tensor, request: Request) -> HardConstraints | None:
    """Allowed tokens and bad words. Should the bad words ban every allowed token, the allowed
    tokens win: the sampler must return some token, and only they are certain."""
    allowed = request.params.allowed_token_ids
    banned = _banned_tokens(request)
    grammar = request.grammar_mask
    if allowed is None and not banned and grammar is None:
        return None
    if grammar is not None:
        row.masked_fill_(~grammar, NEG_INF)
    allowed_mask = None
    if allowed is None:
        keeps_some = len(set(banned)) < row.shape[0]
    else:
        allowed_mask = _cached(request, "allowed_mask", row, _allowed_mask)
        row.masked_fill_(_cached(request, "disallowed_mask", row, _disallowed_mask), NEG_INF)
        allowed_set = _cached(request, "allowed_set", row, _allowed_set)
        keeps_some = len(allowed_set & set(banned)) < len(allowed_set)  # O(len(banned))
    if not keeps_some:
        banned = []
    if banned:
        row[banned] = NEG_INF
    return HardConstraints(allowed_mask, banned, grammar)


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


def _disallowed_mask(request: Request, vocab_size: int) -> torch.Tensor:
    return ~_allowed_mask(request, vocab_size)


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
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long, device=row.device)
        values = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if request.output_counts and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(list(request.output_counts), dtype=torch.long, device=row.device)
        counts = torch.tensor(
            list(request.output_counts.values()), dtype=row.dtype, device=row.device
        )
        row.index_add_(0, ids, -(params.frequency_penalty * counts + params.presence_penalty))
