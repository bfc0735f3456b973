"""The draft-model proposer (``method: draft_model``): a smaller model with the target's
tokenizer proposes each decoding request's next tokens, its most likely ones, in forward passes
of its own that run before the target's step is scheduled.

The draft has its own paged KV cache (a ``KVCacheManager`` without prefix caching) and its own
``ModelRunner``, both built by the engine core. For each request it keeps the tokens its cache
holds. A step first computes what the cache lacks of the request's tokens (the whole prompt the
first time, in chunks within the step's token budget; later the drafts the target accepted and
the token it sampled after them), whose last row gives the first draft, then one row per
further draft. Drafts the target rejected are rolled back: the cache keeps the common prefix of
what it holds and the request's tokens, and the rest is written over.
"""

from __future__ import annotations

import types

from llmrpc.engine.sched.kv_cache import KVCacheManager
from llmrpc.engine.sched.scheduler import SchedulerOutput
from llmrpc.engine.spec_decode.config import SpeculativeConfig
from llmrpc.engine.spec_decode.proposer import Proposer

_NO_PROMPT_LOGPROBS = types.SimpleNamespace(prompt_logprobs=None)


class _DraftSeq:
    """A request as the draft's runner and KV cache see it: ``all_token_ids``, of which the
    cache holds the first ``num_computed_tokens``; the first ``num_real`` are the request's."""

    __slots__ = ("request_id", "all_token_ids", "num_computed_tokens", "num_real")
    # what a runner reads of a request that has no drafts, pooling or prompt logprobs
    spec_token_ids = ()
    pooler_state = None
    params = _NO_PROMPT_LOGPROBS
    rope_long = False  # a longrope draft proposes with its short factors

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_real = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def sync(self, tokens: list[int]) -> None:
        """Take the request's ``tokens`` (which only ever grow): keep the cache's common prefix
        with them, and at least their last token to compute (its row gives the first draft)."""
        held, common = self.all_token_ids, self.num_real
        end = min(len(held), len(tokens))
        while common < end and held[common] == tokens[common]:
            common += 1
        del held[common:]
        held.extend(tokens[common:])
        self.num_computed_tokens = min(self.num_computed_tokens, common, len(tokens) - 1)
        self.num_real = len(tokens)


class DraftModelProposer(Proposer):
    def __init__(
        self,
        config: SpeculativeConfig,
        runner,  # the draft's ModelRunner, its KV cache of kv_manager's blocks
        kv_manager: KVCacheManager,
        max_model_len: int,  # the target's, or the draft's where that is shorter
        vocab_size: int,  # the target's: the draft's logits past it are never proposed
        max_num_tokens: int,  # rows of a step's first forward pass at most (the prompts' part)
    ) -> None:
        super().__init__(config)
        self.runner = runner
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_tokens = max_num_tokens
        self._seqs: dict[str, _DraftSeq] = {}
        self._ready: dict[str, list[int]] = {}  # this step's drafts, by request id

    def propose(self, request, max_drafts: int, batch_size: int) -> list[int]:
        return self._ready.pop(request.request_id, [])[: max(max_drafts, 0)]

    def prepare(self, running: list) -> None:
        """The drafts of this step's decoding requests (``running``'s), for ``propose``: the
        draft model runs now. A request not running (preempted) gives its draft blocks back."""
        self._ready = {}
        running_ids = {request.request_id for request in running}
        for request_id in [i for i in self._seqs if i not in running_ids]:
            self._free(request_id)
        wanted = []
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # a prompt still being computed
            if request.pooler_state is not None:
                continue
            limit = self.max_model_len - request.num_tokens - 1
            max_tokens = request.params.max_tokens
            if max_tokens is not None:
                limit = min(limit, max_tokens - request.num_output_tokens - 1)
            k = self.num_drafts(request, limit, len(running))
            if k:
                wanted.append((request, k))
        if wanted:
            self._ready = self._run(wanted)

    def _run(self, wanted: list[tuple]) -> dict[str, list[int]]:
        """Forward passes of the draft until each request has its drafts: the first computes
        what each cache lacks (within the budget), each later one a row per request."""
        step, limits, budget = [], {}, self.max_num_tokens
        for request, k in wanted:
            seq = self._seqs.get(request.request_id)
            if seq is None:
                seq = self._seqs[request.request_id] = _DraftSeq(request.request_id)
            seq.sync(request.all_token_ids)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new and self.kv_manager.allocate_slots(seq, num_new) is not None:
                step.append((seq, num_new))
                limits[seq] = k
                budget -= num_new
        drafts: dict[str, list[int]] = {}
        while step:
            tokens = self._forward(step)
            next_step = []
            for seq, num_new in step:
                seq.num_computed_tokens += num_new
                token = tokens.get(seq)
                if token is None:  # a chunk of what the cache lacks: no draft this step
                    continue
                seq.all_token_ids.append(token)
                proposed = drafts.setdefault(seq.request_id, [])
                proposed.append(token)
                if (
                    len(proposed) < limits[seq]
                    and self.kv_manager.allocate_slots(seq, 1) is not None
                ):
                    next_step.append((seq, 1))
            step = next_step
        return drafts

    def _forward(self, step: list[tuple[_DraftSeq, int]]) -> dict[_DraftSeq, int]:
        """The draft's most likely next token after each sequence whose last token is in
        ``step`` (a chunk that stops short of it samples nothing)."""
        output = self.runner.execute(SchedulerOutput(scheduled=step), self.kv_manager.block_ids)
        token_ids = output.logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        return dict(zip(output.sampled_requests, token_ids, strict=True))

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._free(request_id)

    def _free(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv_manager.free(seq)
