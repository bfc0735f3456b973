"""Per-request output state: detokenizer, RNG, time limit, and the making of ``RequestOutput``s."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from llmrpc.engine.output.detokenizer import IncrementalDetokenizer
from llmrpc.engine.request import FinishReason, Request, RequestOutput, TokenLogprobs
from llmrpc.engine.timings import detokenize_timed, finish_timings


@dataclass
class _Tracked:
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer | None  # None: no tokenizer (--skip-tokenizer-init)
    generator: torch.Generator
    deadline: float | None
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    sent_prompt_logprobs: bool = False


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index``: the request's own seed for the first, distinct ones after."""
    return seed if index == 0 else hash((seed, index)) % 2**63


class OutputProcessor:
    def __init__(self, tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self._rng = random.Random(seed)
        self._tracked: dict[str, _Tracked] = {}  # internal request id -> state
        self.children: dict[str, list[str]] = {}  # request id -> internal ids of its samples

    def add(self, parent_id: str, requests: list[Request]) -> None:
        params = requests[0].params
        seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
        limit = params.time_limit_s
        for index, request in enumerate(requests):
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                )
            generator = torch.Generator().manual_seed(sample_seed(seed, index))
            deadline = None if limit is None else request.arrival_time + limit
            self._tracked[request.request_id] = _Tracked(
                parent_id, index, detokenizer, generator, deadline
            )
        self.children[parent_id] = [r.request_id for r in requests]

    def generator(self, request_id: str) -> torch.Generator:
        return self._tracked[request_id].generator

    def add_token(
        self, request: Request, logprobs: TokenLogprobs | None, render: bool
    ) -> str | None:
        """Record the request's newest token; returns the stop string it completed, if any.

        ``render`` is False for EOS and stop tokens: they end the output without being text.
        """
        tracked = self._tracked[request.request_id]
        if logprobs is not None:
            tracked.pending_logprobs.append(logprobs)
        if not render or tracked.detokenizer is None:
            return None
        if request.timings is not None:
            return detokenize_timed(tracked.detokenizer, request)
        return tracked.detokenizer.add_token(request.output_token_ids[-1])

    def expired(self, now: float) -> list[str]:
        return [
            rid for rid, t in self._tracked.items() if t.deadline is not None and now >= t.deadline
        ]

    def make_output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        tracked = self._tracked[request.request_id]
        finished = request.is_finished
        if finished:
            self._forget(request.request_id, tracked.parent_id)
        return RequestOutput(
            request_id=tracked.parent_id,
            text=tracked.detokenizer.take_delta(finished) if tracked.detokenizer else "",
            token_ids=new_token_ids,
            finished=finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            index=tracked.index,
            logprobs=self._take_logprobs(request, tracked),
            prompt_logprobs=self._take_prompt_logprobs(request, tracked),
            timings=finish_timings(request) if finished else None,
        )

    def error_output(self, request: Request, message: str) -> RequestOutput:
        """The last output of a request that failed (``FinishReason.ERROR``), made without the
        request's detokenizer, which may be what failed."""
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            self._forget(request.request_id, tracked.parent_id)
        return RequestOutput(
            request_id=tracked.parent_id if tracked is not None else request.request_id,
            text="",
            token_ids=[],
            finished=True,
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=message,
            timings=finish_timings(request),
            index=tracked.index if tracked is not None else 0,
        )

    def _take_logprobs(self, request: Request, tracked: _Tracked) -> list[TokenLogprobs] | None:
        if request.params.logprobs is None:
            return None
        logprobs, tracked.pending_logprobs = tracked.pending_logprobs, []
        return logprobs

    def _take_prompt_logprobs(self, request: Request, tracked: _Tracked):
        if request.params.prompt_logprobs is None or tracked.sent_prompt_logprobs:
            return None
        tracked.sent_prompt_logprobs = True
        return request.prompt_logprobs

    def _forget(self, request_id: str, parent_id: str) -> None:
        del self._tracked[request_id]
        siblings = self.children[parent_id]
        siblings.remove(request_id)
        if not siblings:
            del self.children[parent_id]
