"""Bounds on one request's fan-out, shared by the gRPC server and the REST gateway.

A request may bring several prompts (REST completions' ``prompt`` list, embeddings' ``input``,
the Embed RPC's ``inputs``) and ask for ``n`` samples of each; the engine runs every sample of
every prompt as a sequence of its own. Without a bound, one request of 10,000 prompts held the
engine for 101 s, and 1,000 prompts x n=128 queued 126,723 sequences.
"""

from __future__ import annotations

# --max-prompts-per-request: OpenAI's bound on an embeddings request's inputs (and the Embed
# RPC's), for completions too.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 2048
# --max-sequences-per-request (prompts x n): as many as the prompts alone may be, so n=128
# samples fit 16 prompts, and a full batch of prompts takes n=1.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 2048


def check_fanout_flags(max_prompts: int, max_sequences: int) -> None:
    """ValueError naming the flag of a bound below 1."""
    for flag, value in (
        ("--max-prompts-per-request", max_prompts),
        ("--max-sequences-per-request", max_sequences),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be 1 or more, got {value}")
