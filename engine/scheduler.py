"""Token-budget scheduler: continuous batching with chunked prefill and preemption by recompute.

There are no prefill and decode phases. Each step, every running request is given tokens until its
``num_computed_tokens`` reaches its ``num_tokens`` (one token for a decoding request, a chunk of a
prompt otherwise), then waiting requests join under what is left of the step's token budget.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from llmrpc.engine.config import SchedulerConfig
from llmrpc.engine.kv_cache import KVCacheManager
from llmrpc.engine.request import FinishReason, Request, RequestStatus

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
        self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if not output.preempted:
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv_manager.allocate_slots(request, num_new) is None:
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    return budget
            output.scheduled.append((request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = self.kv_manager.get_computed_blocks(request)
            num_hit_tokens = len(hits) * self.kv_manager.block_size
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_manager.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append((request, num_new))
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        """Return a request to the front of the queue; it is recomputed from its tokens later."""
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance scheduled requests; append sampled tokens and apply token-level stops.

        Returns the requests that received a new token this step.
        """
        updated = []
        for request, num_scheduled in output.scheduled:
            request.num_computed_tokens += num_scheduled
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None:  # a chunk of a prompt that is not finished yet
                continue
            request.append_output_token(token_id)
            updated.append(request)
            self._check_token_stop(request, token_id)
        return updated

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
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv_manager.free(request)
        del self.requests[request.request_id]
