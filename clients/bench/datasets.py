"""Benchmark prompts: random token ids of an exact length, or the first turns of a ShareGPT file.

Random prompts are token ids, sent as ids (never retokenized), so every prompt is exactly
``input_len`` tokens whatever the tokenizer; with ``ignore_eos`` every output is exactly
``output_len`` tokens, and token counts in the results add up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from llmrpc.common.sharegpt import first_human_turns

# Token ids below this are left out of random prompts: tokenizers put their special tokens
# (BOS, EOS, padding, chat markers) at the start of the vocabulary, and a prompt full of them
# is not what users send.
_FIRST_ORDINARY_TOKEN = 100


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: text or token ids, and the number of tokens to ask for."""

    prompt: str | list[int]
    output_len: int

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens when known before sending (token-id prompts), else None."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    shared_prefix_len: int = 0,
) -> list[BenchRequest]:
    """``num_prompts`` prompts of ``input_len`` random token ids each, all after the same
    ``shared_prefix_len`` random tokens (a common system prompt; 0: nothing shared)."""
    if vocab_size <= _FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small for random prompts")
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(_FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(count)]

    prefix = tokens(shared_prefix_len)
    return [BenchRequest(prefix + tokens(input_len), output_len) for _ in range(num_prompts)]


def sharegpt_requests(
    path: str | Path, num_prompts: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """First human turns of a ShareGPT-format JSON file, sampled with ``seed``, as text
    (``common.sharegpt``)."""
    chosen = first_human_turns(path, num_prompts, seed)
    return [BenchRequest(prompt, output_len) for prompt in chosen]
