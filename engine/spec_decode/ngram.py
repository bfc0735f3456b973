"""The n-gram proposer (``method: ngram``, vLLM's prompt lookup), its per-request back-off, and
the acceptance counters behind the ``vllm:spec_decode_*`` metrics.

A proposal: the longest suffix of the request's tokens (prompt and output), between
``prompt_lookup_max`` and ``prompt_lookup_min`` tokens long, that occurred earlier in them; the
tokens that followed an earlier occurrence are the drafts (``lookup`` says which). A draft is a
single token, not a distribution, so verification (``engine/core/engine_core.py``) keeps the
target's distribution exactly by drawing each position from it and accepting while the draw
equals the draft.

Back-off: a proposal of which no draft was accepted costs a verify step of several rows for one
token. After one, the request proposes nothing for its next 1 step, after two in a row for 2,
then 4, ... up to ``MAX_SKIP`` steps; an accepted draft ends the run of misses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llmrpc.engine.spec_decode.config import SpeculativeConfig

MAX_SKIP = 32  # steps a request that keeps missing waits at most before it proposes again


@dataclass
class SpecStats:
    """Counted since start, as vLLM's ``spec_decode`` counters: proposals verified, their draft
    tokens, the drafts accepted, and of those the accepted at each draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step gave per proposal: the accepted drafts and the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class _History:
    """A request's tokens as a growing numpy array (appended to, never rebuilt), and its
    back-off: ``misses`` proposals in a row with nothing accepted, ``skip`` steps left to wait."""

    __slots__ = ("tokens", "length", "misses", "skip")

    def __init__(self) -> None:
        self.tokens = np.empty(256, dtype=np.int64)
        self.length = 0
        self.misses = 0
        self.skip = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        new = len(token_ids) - self.length
        if new > 0:
            if len(token_ids) > len(self.tokens):
                grown = np.empty(max(2 * len(self.tokens), len(token_ids)), dtype=np.int64)
                grown[: self.length] = self.tokens[: self.length]
                self.tokens = grown
            self.tokens[self.length : len(token_ids)] = token_ids[self.length :]
            self.length = len(token_ids)
        return self.tokens[: self.length]


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix of
    ``tokens`` that is ``min_n`` to ``max_n`` long and occurred before ([] if none did): the
    latest occurrence followed by ``k`` tokens, else the earliest (in a loop of period p the
    latest is followed by p tokens, the earliest by more)."""
    length = len(tokens)
    if length <= min_n or k <= 0:
        return []
    last = length - 1
    # candidates: earlier positions holding the last token; then how far back each agrees
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    if not len(ends):
        return []
    matched = np.ones(len(ends), dtype=np.int64)
    agreeing = np.ones(len(ends), dtype=bool)
    for back in range(1, max_n):
        if back > last:
            break
        inside = ends >= back
        agreeing &= inside
        agreeing[inside] &= tokens[ends[inside] - back] == tokens[last - back]
        if not agreeing.any():
            break
        matched += agreeing
    best = int(matched.max())
    if best < min_n:
        return []
    longest = ends[matched == best]
    whole = longest[longest + k < last]  # followed by k tokens (a loop's latest is not)
    end = int(whole[-1] if len(whole) else longest[0])
    return tokens[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._histories: dict[str, _History] = {}

    def propose(self, request, max_drafts: int, batch_size: int) -> list[int]:
        """The drafts to verify after ``request``'s last token, at most ``max_drafts`` (the
        scheduler's limit: budget, max_tokens, context); [] when speculation is off for it."""
        config = self.config
        limit = config.disable_by_batch_size
        if max_drafts <= 0 or (limit is not None and batch_size >= limit):
            return []
        k = min(max_drafts, config.num_speculative_tokens)
        if config.max_model_len is not None:
            k = min(k, config.max_model_len - request.num_tokens)
            if k <= 0:
                return []
        history = self._histories.get(request.request_id)
        if history is None:
            history = self._histories[request.request_id] = _History()
        if history.skip:
            history.skip -= 1
            return []
        tokens = history.sync(request.all_token_ids)
        return lookup(tokens, config.prompt_lookup_min, config.prompt_lookup_max, k)

    def verified(self, request, num_drafts: int, num_accepted: int) -> None:
        """Count one verified proposal and update the request's back-off."""
        self.stats.record(num_drafts, num_accepted)
        history = self._histories.get(request.request_id)
        if history is None:
            return
        if num_accepted:
            history.misses = 0
        else:
            history.skip = min(2**history.misses, MAX_SKIP)
            history.misses += 1

    def forget(self, request_id: str) -> None:
        self._histories.pop(request_id, None)
