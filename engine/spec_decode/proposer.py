"""What every proposer shares: how many drafts a request proposes, its back-off, and the
acceptance counters behind the ``vllm:spec_decode_*`` metrics.

A draft is a single token, not a distribution (the n-gram lookup's continuation, the draft
model's most likely token), so verification (``engine/core/engine_core.py``) keeps the target's
distribution exactly by drawing each position from it and accepting while the draw equals the
draft.

How many drafts: a draft row costs the step what one more row of the batch costs, and pays
only if it is accepted, when it saves the request a step's share per token. Steps are timed
(``StepCost``: step time against rows, fitted as ``t0 + c * rows`` over recent steps), and
each request keeps an estimate ``p`` of the chance that its next draft is accepted; the i-th
draft is proposed while ``p ** i`` (the chance it is reached and taken) is at least the cost
of its row over what an accepted token is worth, ``c / (t0 / batch + c)``. At one stream the
weights' read dominates and nearly every draft pays; in a large batch whose rows cost compute,
only requests whose drafts are mostly accepted propose.

Back-off: a proposal of which no draft was accepted costs a verify step of several rows for one
token. After one, the request proposes nothing for its next 1 step, after two in a row for 2,
then 4, ... up to ``MAX_SKIP`` steps; an accepted draft ends the run of misses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llmrpc.engine.core_types import SpecDecodeCounts
from llmrpc.engine.spec_decode.config import SpeculativeConfig

MAX_SKIP = 32  # steps a request that keeps missing waits at most before it proposes again
_DECAY = 0.8  # weight of a request's earlier proposals in its acceptance estimate, per proposal
_COST_WINDOW = 64  # steps the cost fit looks back over


class StepCost:
    """Recent steps' seconds (scheduling to outputs) against their rows, fitted by least squares as
    ``t0 + c * rows``; ``row_share(batch)``: what one more row costs relative to the time a
    step spends per request, ``c / (t0 / batch + c)`` (0 until the fit has varied rows)."""

    def __init__(self) -> None:
        self._rows: list[int] = []
        self._seconds: list[float] = []
        self._fit: tuple[float, float] | None = None  # (t0, c)

    def add(self, rows: int, seconds: float) -> None:
        self._rows.append(rows)
        self._seconds.append(seconds)
        if len(self._rows) > _COST_WINDOW:
            del self._rows[0], self._seconds[0]
        rows_ = np.array(self._rows, dtype=np.float64)
        if len(rows_) < 8 or rows_.std() < 1:
            return
        slope, intercept = np.polyfit(rows_, np.array(self._seconds), 1)
        if slope > 0 and intercept > 0:
            self._fit = (float(intercept), float(slope))

    def row_share(self, batch: int) -> float:
        if self._fit is None:
            return 0.0
        t0, c = self._fit
        return c / (t0 / max(batch, 1) + c)


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

    def counts(self) -> SpecDecodeCounts:
        return SpecDecodeCounts(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.accepted_per_pos),
        )


class _History:
    """A request's tokens as a growing numpy array (appended to, never rebuilt), and its
    back-off: ``misses`` proposals in a row with nothing accepted, ``skip`` steps left to wait."""

    __slots__ = ("tokens", "length", "misses", "skip", "accepted", "rejected")

    def __init__(self) -> None:
        self.tokens = np.empty(256, dtype=np.int64)
        self.length = 0
        self.misses = 0
        self.skip = 0
        # decayed counts of drafts accepted and of proposals cut short by a rejection
        self.accepted = 0.0
        self.rejected = 0.0

    @property
    def acceptance(self) -> float:
        """The chance the next draft is accepted: a proposal's accepted run is geometric, so
        accepted / (accepted + rejections), starting from 1 (two accepted, no rejection)."""
        return (self.accepted + 2) / (self.accepted + self.rejected + 2)

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


class Proposer:
    """A method's proposals are ``propose``'s (called by the scheduler for each decode, within
    its limits); ``num_drafts`` says how many a request should propose this step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.cost = StepCost()  # the engine adds each step's rows and seconds
        self._histories: dict[str, _History] = {}

    def propose(self, request, max_drafts: int, batch_size: int) -> list[int]:
        """The drafts to verify after ``request``'s last token, at most ``max_drafts`` (the
        scheduler's limit: budget, max_tokens, context); [] when speculation is off for it."""
        raise NotImplementedError

    def prepare(self, running: list) -> None:
        """Before the step is scheduled, with the running requests (a proposer that computes
        its drafts in batches computes them here)."""

    def history(self, request) -> _History:
        history = self._histories.get(request.request_id)
        if history is None:
            history = self._histories[request.request_id] = _History()
        return history

    def num_drafts(self, request, max_drafts: int, batch_size: int) -> int:
        """How many drafts ``request`` proposes this step (0: none): ``disable_by_batch_size``,
        ``max_model_len``, its back-off (a step it waits is spent here), and the drafts whose
        chance of acceptance pays for their rows."""
        config = self.config
        limit = config.disable_by_batch_size
        if max_drafts <= 0 or (limit is not None and batch_size >= limit):
            return 0
        k = min(max_drafts, config.num_speculative_tokens)
        if config.max_model_len is not None:
            k = min(k, config.max_model_len - request.num_tokens)
            if k <= 0:
                return 0
        history = self.history(request)
        if history.skip:
            history.skip -= 1
            return 0
        share, p = self.cost.row_share(batch_size), history.acceptance
        while k and p**k < share:
            k -= 1
        return k

    def verified(self, request, num_drafts: int, num_accepted: int) -> None:
        """Count one verified proposal and update the request's back-off."""
        self.stats.record(num_drafts, num_accepted)
        history = self._histories.get(request.request_id)
        if history is None:
            return
        history.accepted = _DECAY * history.accepted + num_accepted
        history.rejected = _DECAY * history.rejected + (num_accepted < num_drafts)
        if num_accepted:
            history.misses = 0
        else:
            history.skip = min(2**history.misses, MAX_SKIP)
            history.misses += 1

    def forget(self, request_id: str) -> None:
        self._histories.pop(request_id, None)
