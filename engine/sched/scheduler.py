"""Token-budget scheduler: continuous batching with chunked prefill and preemption by recompute.

There are no prefill and decode phases. Each step, every running request is given tokens until its
``num_computed_tokens`` reaches its ``num_tokens`` (one token for a decoding request, with the
proposer's drafts under speculative decoding; a chunk of a prompt otherwise), then waiting
requests join under what is left of the step's token budget. While requests wait for a seat, a
prompt in progress takes at most a share of the budget, so a long prefill holds no newcomer back;
what the queue leaves goes back to the prompts. Waiting requests are taken in the waiting queue's
order (``request_queue``: callers in turn).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from llmrpc.engine.config import SchedulerConfig
from llmrpc.engine.lora.types import LoRAAdmission
from llmrpc.engine.request import FinishReason, Request, RequestStatus
from llmrpc.engine.sched.kv_cache import KVCacheManager
from llmrpc.engine.sched.request_queue import make_waiting_queue

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    # (request, num_scheduled_tokens) in batch order
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        max_loras: int | None = None,  # --max-loras under --enable-lora
        proposer=None,  # --speculative-config: drafts for decoding requests (engine/spec_decode)
        long_rope_from: int | None = None,  # a longrope model's original_max_position_embeddings
    ) -> None:
        self.config = config
        self.max_loras = max_loras
        self.proposer = proposer
        self.long_rope_from = long_rope_from
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        self.waiting = make_waiting_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Waiting for their structured output's grammar to compile; they queue once it has,
        # so a long compile holds up no other request.
        self.compiling: list[Request] = []

    def add_request(self, request: Request) -> None:
        self._update_rope(request)
        if request.grammar is not None and not request.grammar.ready:
            self.compiling.append(request)
        else:
            self.waiting.add(request)
        self.requests[request.request_id] = request

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.compiling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.compiling)

    def compiled(self) -> list[Request]:
        """Move the requests whose grammar is ready to the queue; returns those whose grammar
        failed to compile (still unfinished, for the caller to fail)."""
        failed, still = [], []
        for request in self.compiling:
            if not request.grammar.ready:
                still.append(request)
            elif request.grammar.error() is not None:
                failed.append(request)
            else:
                self.waiting.add(request)
        self.compiling = still + failed  # failed ones leave through finish_request
        return failed

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        chunks = _ChunkRules(self.config)
        budget = self.config.max_num_batched_tokens
        share = self._prompt_share(budget)
        budget = self._schedule_running(output, budget, chunks, share)
        if not output.preempted:
            budget = self._schedule_waiting(output, budget, chunks)
        if budget and share < self.config.max_num_batched_tokens:
            self._extend_prompt_chunks(output, budget, chunks)
        return output

    def _prompt_share(self, budget: int) -> int:
        """Most tokens a running prompt gets before the decodes and the queue have had their turn.

        The running prompts, and the queue as one while a request there may take a seat, share
        equally what the decodes leave of the budget.
        """
        config = self.config
        if not config.enable_chunked_prefill:
            return budget  # no prompt is in progress: each is computed in one step
        num_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        num_prompts = len(self.running) - num_decodes
        queue_joins = bool(self.waiting) and len(self.running) < config.max_num_seqs
        if not num_prompts or (num_prompts + queue_joins == 1 and not num_decodes):
            return budget
        return max(1, (budget - num_decodes) // (num_prompts + queue_joins))

    def _schedule_running(self, output: SchedulerOutput, budget: int, chunks, share: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._update_rope(request):  # its KV is recomputed with the long factors
                self.running.remove(request)
                self._preempt(request, recompute=True)
                continue
            index += 1
            num_computed = request.num_computed_tokens
            num_new = chunks.num_new_tokens(request, num_computed, min(budget, share))
            if not num_new:  # its whole rest, where its share would be a split the limits refuse
                num_new = chunks.num_new_tokens(request, num_computed, budget)
            if not num_new:
                continue
            request.spec_token_ids = self._drafts(request, num_computed, num_new, budget)
            if request.spec_token_ids:  # its KV slots too, or no drafts this step
                num_drafts = len(request.spec_token_ids)
                if self.kv_manager.allocate_slots(request, num_new + num_drafts) is not None:
                    chunks.take(request, num_computed, num_new)
                    output.scheduled.append((request, num_new + num_drafts))
                    budget -= num_new + num_drafts
                    continue
                request.spec_token_ids = []
            while self.kv_manager.allocate_slots(request, num_new) is None:
                victim = self._preemption_victim()
                # The victim may be one scheduled earlier in this step (priority policy): it
                # leaves the step and gives its tokens back.
                budget += self._unschedule(output, victim, chunks)
                self.running.remove(victim)
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:  # the requests behind it still run
                    index -= 1
                    break
                index = self.running.index(request) + 1
            else:
                chunks.take(request, request.num_computed_tokens, num_new)
                output.scheduled.append((request, num_new))
                budget -= num_new
        return budget

    def _drafts(self, request: Request, num_computed: int, num_new: int, budget: int) -> list[int]:
        """The proposer's drafts for a decode (none for a prompt's chunk), within what is left
        of the step's budget, the request's max_tokens and the context window."""
        if self.proposer is None or num_new != 1 or request.num_tokens - num_computed != 1:
            return []
        if request.pooler_state is not None:
            return []
        limit = min(budget - 1, self.max_model_len - request.num_tokens - 1)
        if self.long_rope_from is not None and not request.rope_long:  # no row past the switch
            limit = min(limit, self.long_rope_from - request.num_tokens)
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        return self.proposer.propose(request, limit, len(self.running))

    @staticmethod
    def _unschedule(output: SchedulerOutput, request: Request, chunks: _ChunkRules) -> int:
        """Take ``request`` out of this step's schedule; returns the tokens it had."""
        for position, (scheduled, num_new) in enumerate(output.scheduled):
            if scheduled is request:
                del output.scheduled[position]
                num_drafts = len(request.spec_token_ids)
                request.spec_token_ids = []
                chunks.untake(request, request.num_computed_tokens, num_new - num_drafts)
                return num_new
        return 0

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, chunks) -> int:
        loras = LoRAAdmission(self.max_loras, self.running) if self.max_loras else None
        # Their adapter finds no slot, or their prompt neither fits whole nor may be split
        # (partial-prefill limits) this step: they keep their place, others pass.
        held = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if loras is not None and not loras.admits(request):
                held.append(self.waiting.pop())
                continue
            if self.config.enable_chunked_prefill and not self._may_start(request, budget, chunks):
                held.append(self.waiting.pop())
                continue
            hits = self.kv_manager.get_computed_blocks(request)
            num_hit_tokens = len(hits) * self.kv_manager.block_size
            num_new = chunks.num_new_tokens(request, num_hit_tokens, budget)
            if num_new and self.kv_manager.allocate_slots(request, num_new, hits) is None:
                break
            if not num_new:
                if not self.config.enable_chunked_prefill:
                    break  # the whole prompt in a later step; those behind it keep their place
                held.append(self.waiting.pop())
                continue
            self.waiting.pop()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.take(request, num_hit_tokens, num_new)
            output.scheduled.append((request, num_new))
            budget -= num_new
            if loras is not None:
                loras.admit(request)
        for request in reversed(held):
            self.waiting.add_preempted(request)
        return budget

    def _may_start(self, request: Request, budget: int, chunks: _ChunkRules) -> bool:
        """False when even a prefix hit of all its full blocks leaves a split the limits refuse
        (no need to look the blocks up)."""
        size = self.kv_manager.block_size
        num_hit_tokens = (
            (request.num_tokens - 1) // size * size if self.kv_manager.enable_caching else 0
        )
        return bool(chunks.num_new_tokens(request, num_hit_tokens, budget))

    def _extend_prompt_chunks(self, output: SchedulerOutput, budget: int, chunks) -> None:
        """Give what the queue left of the budget to the prompts cut short, in batch order."""
        for position, (request, num_new) in enumerate(output.scheduled):
            if not budget:
                return
            num_computed = request.num_computed_tokens
            if num_new >= request.num_tokens - num_computed:
                continue  # a decode, or a prompt's whole rest
            chunks.untake(request, num_computed, num_new)
            more = chunks.num_new_tokens(request, num_computed, num_new + budget)
            if more > num_new and self.kv_manager.allocate_slots(request, more) is not None:
                output.scheduled[position] = (request, more)
                budget -= more - num_new
                num_new = more
            chunks.take(request, num_computed, num_new)

    def _preemption_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":  # the least urgent, latest arrival
            return max(self.running, key=lambda r: (r.params.priority, r.arrival_time))
        return self.running[-1]  # the newest

    def _preempt(self, request: Request, recompute: bool = False) -> None:
        """Return a request to the queue; it is recomputed from its tokens later. ``recompute``:
        not for room but because its KV must be computed anew (not counted as a preemption)."""
        request.spec_token_ids = []
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += not recompute
        request.status = RequestStatus.PREEMPTED
        self.waiting.add_preempted(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    def _update_rope(self, request: Request) -> bool:
        """Longrope: a request longer than ``long_rope_from`` takes the long factors in every
        row, as Transformers' Phi-3 does (at the switch it recomputes the cache). True when the
        request just switched with KV computed before: it must be recomputed."""
        if self.long_rope_from is None or request.rope_long:
            return False
        if request.num_tokens <= self.long_rope_from:
            return False
        request.rope_long = True
        request.block_hashes = []  # its chain of block hashes starts from the long factors
        return request.num_computed_tokens > 0

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        failed: dict[Request, str] | None = None,
    ) -> list[Request]:
        """Advance scheduled requests; append sampled tokens and apply token-level stops.

        Returns the requests that received a new token this step. Requests in ``failed`` are
        skipped; one whose update raises is added to it (with the error) instead.
        """
        failed = {} if failed is None else failed
        updated = []
        for request, num_scheduled in output.scheduled:
            if request in failed:
                continue
            try:
                if self._update_request(request, num_scheduled, sampled_token_ids):
                    updated.append(request)
            except Exception as error:  # noqa: BLE001 - this request's own fault
                failed[request] = f"updating the request failed: {error!r}"
        return updated

    def _update_request(self, request: Request, num_scheduled: int, sampled: dict) -> bool:
        # drafts count as computed only once accepted (accept_draft)
        request.num_computed_tokens += num_scheduled - len(request.spec_token_ids)
        token_id = sampled.get(request.request_id)
        if token_id is None:  # a chunk of a prompt that is not finished yet
            return False
        self.append_token(request, token_id)
        return True

    def append_token(self, request: Request, token_id: int) -> None:
        """A sampled token joins the request's output; token-level stops apply."""
        request.append_output_token(token_id)
        self._check_token_stop(request, token_id)

    @staticmethod
    def accept_draft(request: Request) -> None:
        """The draft after the request's computed tokens was what the target sampled: the KV
        the verify step wrote for it holds, so it counts as computed."""
        request.num_computed_tokens += 1

    def _check_token_stop(self, request: Request, token_id: int) -> None:
        params = request.params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            self.finish_request(request, FinishReason.EOS, token_id)
        elif token_id in params.stop_token_ids:
            self.finish_request(request, FinishReason.STOP_TOKEN, token_id)
        elif (
            params.max_tokens is not None
            and request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            self.finish_request(request, FinishReason.LENGTH)

    def finish_request(
        self, request: Request, reason: FinishReason, stop_reason: str | int | None = None
    ) -> None:
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.compiling:
            self.compiling.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv_manager.free(request)
        del self.requests[request.request_id]
        if self.proposer is not None:
            self.proposer.forget(request.request_id)


class _ChunkRules:
    """How many tokens a request may compute this step under the chunked-prefill settings.

    A prompt that this step leaves part-computed is a partial prefill; at most
    ``max_num_partial_prefills`` of them per step, of which ``max_long_partial_prefills`` may be
    longer than ``long_prefill_token_threshold``, which also caps one request's chunk.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.num_partial = 0
        self.num_long_partial = 0

    def num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        remaining = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        num_new = min(remaining, budget)
        if threshold and remaining > 1:
            num_new = min(num_new, threshold)
        if num_new == remaining:
            return num_new
        if not self.config.enable_chunked_prefill:
            return 0  # the whole prompt in one step, or not this step
        if self.num_partial >= self.config.max_num_partial_prefills:
            return 0
        if (
            self._is_long(remaining)
            and self.num_long_partial >= self.config.max_long_partial_prefills
        ):
            return 0
        return num_new

    def take(self, request: Request, num_computed: int, num_new: int) -> None:
        remaining = request.num_tokens - num_computed
        if num_new < remaining:
            self.num_partial += 1
            self.num_long_partial += self._is_long(remaining)

    def untake(self, request: Request, num_computed: int, num_new: int) -> None:
        remaining = request.num_tokens - num_computed
        if num_new < remaining:
            self.num_partial -= 1
            self.num_long_partial -= self._is_long(remaining)

    def _is_long(self, remaining: int) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return bool(threshold) and remaining > threshold
