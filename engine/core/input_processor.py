"""Turns an incoming request into engine ``Request`` objects: checks, truncation, n samples."""

from __future__ import annotations

import time
from dataclasses import dataclass

from llmrpc.engine.matching import SequenceAutomaton, SuffixTracker
from llmrpc.engine.request import InvalidRequestError, Request, SamplingParams


@dataclass(frozen=True)
class InputLimits:
    max_model_len: int
    vocab_size: int
    max_logprobs: int  # -1: unlimited


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Internal ids of the n samples of one request (the request's own id when n is 1)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class InputProcessor:
    def __init__(self, limits: InputLimits, tokenizer, eos_token_ids: frozenset[int]) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def make_requests(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> list[Request]:
        """One ``Request`` per sample; raises ``InvalidRequestError`` naming a wrong field."""
        params.validate()
        if self.tokenizer is None:
            for name in ("stop", "bad_words"):
                if getattr(params, name):
                    raise InvalidRequestError(
                        name, "needs a tokenizer; this server runs with --skip-tokenizer-init"
                    )
        if params.truncate_prompt_tokens is not None:
            prompt = prompt[-params.truncate_prompt_tokens :]
        self._check_prompt(prompt, room=0 if params.pooling is not None else 1)
        self._check_params(prompt, params)
        bad_words = None
        if params.bad_words:
            bad_words = SequenceAutomaton(self._tokenize_bad_words(params.bad_words))
        now = time.monotonic()
        params_cache: dict[str, object] = {}  # one for the n samples: they share params
        requests = []
        for child_id in child_request_ids(request_id, params.n):
            request = Request(child_id, prompt, params, self.eos_token_ids, now)
            request.params_cache = params_cache
            if bad_words is not None:
                request.bad_words = SuffixTracker(bad_words)
            requests.append(request)
        return requests

    def _check_prompt(self, prompt: list[int], room: int) -> None:
        """``room``: output tokens the context must leave (none for a pooling request)."""
        limits = self.limits
        if not prompt:
            raise InvalidRequestError("input", "the prompt is empty")
        if len(prompt) + room > limits.max_model_len:  # before reading the tokens: O(1)
            raise InvalidRequestError(
                "input",
                f"the prompt has {len(prompt)} tokens; the model's context length is "
                f"{limits.max_model_len}"
                + (
                    ", which leaves no room for output"
                    if room
                    else " (truncate_prompt_tokens cuts it)"
                ),
            )
        if any(not 0 <= t < limits.vocab_size for t in prompt):
            raise InvalidRequestError("input", f"token ids must be in [0, {limits.vocab_size})")

    def _check_params(self, prompt: list[int], params: SamplingParams) -> None:
        limits = self.limits
        if params.max_tokens is not None and len(prompt) + params.max_tokens > limits.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"{params.max_tokens} output tokens after a {len(prompt)}-token prompt exceed "
                f"the model's context length of {limits.max_model_len}",
            )
        allowed = params.allowed_token_ids or []
        if len(allowed) > limits.vocab_size:  # the other lists are bounded by SamplingParams
            raise InvalidRequestError(
                "allowed_token_ids", f"at most {limits.vocab_size} entries (the vocabulary size)"
            )
        token_lists = {
            "stop_token_ids": params.stop_token_ids,
            "allowed_token_ids": allowed,
            "logit_bias": list(params.logit_bias),
        }
        for name, token_ids in token_lists.items():
            if any(not 0 <= t < limits.vocab_size for t in token_ids):
                raise InvalidRequestError(name, f"token ids must be in [0, {limits.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            self._check_num_logprobs(name, getattr(params, name))

    def _check_num_logprobs(self, name: str, value: int | None) -> None:
        limits = self.limits
        if value is not None and 0 <= limits.max_logprobs < value:
            raise InvalidRequestError(
                name, f"at most {limits.max_logprobs} (the server's --max-logprobs)"
            )
        # Even with --max-logprobs -1 (no limit): a top-N beyond the vocabulary cannot exist.
        if value is not None and value > limits.vocab_size:
            raise InvalidRequestError(name, f"at most {limits.vocab_size} (the vocabulary size)")

    def _tokenize_bad_words(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as it reads alone and after a space (tokenizers tell them apart).

        A tokenizer may know more tokens than the model has logits; a word with such a token
        can never be generated, and banning its id would index past the logits row."""
        token_ids = []
        for word in bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                in_vocab = all(t < self.limits.vocab_size for t in ids)
                if ids and in_vocab and ids not in token_ids:
                    token_ids.append(ids)
        return token_ids
