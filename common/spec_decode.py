"""Speculative decoding's counters, as the engine keeps them and GetLoad reports them: one type
for the engine (summed over data-parallel engines) and its clients (differences of two readings)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Counted since start, as vLLM's ``vllm:spec_decode_*`` counters."""

    num_drafts: int  # proposals verified
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # accepted at each draft position

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step gave, on average: the accepted drafts and the model's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def __add__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        """Two engines' counts (``--data-parallel-size``), position by position."""
        return self._combine(other, 1)

    def __sub__(self, earlier: SpecDecodeCounts) -> SpecDecodeCounts:
        """The counts since ``earlier``, a reading of the same server."""
        return self._combine(earlier, -1)

    def _combine(self, other: SpecDecodeCounts, sign: int) -> SpecDecodeCounts:
        longest = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        ours = self.accepted_per_pos + (0,) * (longest - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + (0,) * (longest - len(other.accepted_per_pos))
        return SpecDecodeCounts(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            tuple(a + sign * b for a, b in zip(ours, theirs, strict=True)),
        )
