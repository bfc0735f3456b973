"""Per-request logits rules applied before sampling, with vLLM's semantics.

Order: allowed tokens, bad words, min_tokens, logit bias, then penalties. Each works in place on
a ``[num_requests, vocab_size]`` float32 tensor and skips the requests that do not use it.
"""

from __future__ import annotations

import torch

from llmrpc.engine.request import Request

NEG_INF = float("-inf")


def apply_logits_processors(logits: torch.Tensor, requests: list[Request]) -> None:
    for row, request in enumerate(requests):
        params = request.params
        if params.allowed_token_ids is not None:
            _keep_only(logits[row], params.allowed_token_ids)
        if request.bad_words_token_ids:
            _ban_bad_words(logits[row], request)
        if request.num_output_tokens < params.min_tokens:
            _mask_stop_tokens(logits[row], request)
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            logits[row].index_add_(0, ids, torch.tensor(list(params.logit_bias.values())))
        if params.has_penalties:
            _apply_penalties(logits[row], request)


def _keep_only(row: torch.Tensor, token_ids: list[int]) -> None:
    keep = row[token_ids].clone()
    row.fill_(NEG_INF)
    row[token_ids] = keep


def _ban_bad_words(row: torch.Tensor, request: Request) -> None:
    """Ban the last token of a bad word whose other tokens the output just produced."""
    output = request.output_token_ids
    for word in request.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or output[len(output) - len(prefix) :] == prefix:
            row[word[-1]] = NEG_INF


def _mask_stop_tokens(row: torch.Tensor, request: Request) -> None:
    """Below ``min_tokens``, EOS and stop tokens cannot be picked."""
    stops = set(request.params.stop_token_ids)
    if not request.params.ignore_eos:
        stops |= request.eos_token_ids
    if stops:
        row[sorted(stops)] = NEG_INF


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
