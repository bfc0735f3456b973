"""The n-gram proposer (``method: ngram``, vLLM's prompt lookup).

A proposal: the longest suffix of the request's tokens (prompt and output), between
``prompt_lookup_max`` and ``prompt_lookup_min`` tokens long, that occurred earlier in them; the
tokens that followed an earlier occurrence are the drafts (``lookup`` says which). How many,
and when a request backs off: ``proposer.Proposer``.
"""

from __future__ import annotations

import numpy as np

from llmrpc.engine.spec_decode.proposer import Proposer


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


class NgramProposer(Proposer):
    def propose(self, request, max_drafts: int, batch_size: int) -> list[int]:
        """The drafts to verify after ``request``'s last token, at most ``max_drafts`` (the
        scheduler's limit: budget, max_tokens, context); [] when speculation is off for it."""
        k = self.num_drafts(request, max_drafts, batch_size)
        if not k:
            return []
        tokens = self.history(request).sync(request.all_token_ids)
        config = self.config
        return lookup(tokens, config.prompt_lookup_min, config.prompt_lookup_max, k)
