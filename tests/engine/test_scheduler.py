"""Token-budget scheduling: exact schedules for chunked prefill, joins, limits and preemption."""

from __future__ import annotations

import weakref

from llmrpc.engine.config import SchedulerConfig
from llmrpc.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from llmrpc.engine.sched.kv_cache import KVCacheManager
from llmrpc.engine.sched.scheduler import Scheduler, SchedulerOutput

BLOCK = 4

# Per scheduler, what the steps' forward passes wrote to the KV cache: slot -> token id.
_KV_WRITTEN: weakref.WeakKeyDictionary[Scheduler, dict[int, int]] = weakref.WeakKeyDictionary()


def make_scheduler(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=8, caching=True, **more):
    manager = KVCacheManager(num_blocks, BLOCK, enable_caching=caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, **more
    )
    return Scheduler(config, manager, max_model_len=1024)


def add(scheduler, request_id, num_prompt_tokens, max_tokens=100, first_token=0, priority=0):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)
    tokens = list(range(first_token, first_token + num_prompt_tokens))
    request = Request(request_id, tokens, params)
    scheduler.add_request(request)
    return request


def step(scheduler) -> tuple[list[tuple[str, int]], SchedulerOutput]:
    """Schedule one step, write its tokens' KV as the model runner would, feed back token 7
    for every request that reached its end, then check the prefix cache."""
    output = scheduler.schedule()
    write_kv(scheduler, output)
    sampled = {
        r.request_id: 7 for r, n in output.scheduled if r.num_computed_tokens + n == r.num_tokens
    }
    scheduler.update_from_output(output, sampled)
    check_prefix_cache(scheduler)
    return [(r.request_id, n) for r, n in output.scheduled], output


def write_kv(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """The forward pass's writes: each scheduled token into its slot (block_id * size + offset)."""
    written = _KV_WRITTEN.setdefault(scheduler, {})
    manager = scheduler.kv_manager
    for request, num_new in output.scheduled:
        block_ids = manager.block_ids(request.request_id)
        for position in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
            slot = block_ids[position // BLOCK] * BLOCK + position % BLOCK
            written[slot] = request.all_token_ids[position]


def check_prefix_cache(scheduler: Scheduler) -> None:
    """No block in the prefix cache holds tokens whose KV was not written: a request that hits
    it would attend to whatever the block held before."""
    manager = scheduler.kv_manager
    written = _KV_WRITTEN.get(scheduler, {})
    for block in manager.pool.cached.values():
        slots = range(block.block_id * BLOCK, (block.block_id + 1) * BLOCK)
        kv = tuple(written.get(slot) for slot in slots)
        assert kv == block.token_ids, f"block {block.block_id} cached as {block.token_ids}: {kv}"
    for request in scheduler.running:  # a cached block's tokens are all computed by its owner
        for index, block in enumerate(manager.req_blocks.get(request.request_id, ())):
            if block.block_hash is not None:
                assert (index + 1) * BLOCK <= request.num_computed_tokens, (request, index)


def test_long_prompt_is_chunked_and_newcomers_join_the_running_batch():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, "a", 20)
    assert step(scheduler)[0] == [("a", 16)]
    add(scheduler, "b", 5, first_token=200)
    assert step(scheduler)[0] == [("a", 4), ("b", 5)]  # a's last chunk, b joins
    add(scheduler, "c", 30, first_token=100)
    # a and b decode one token each; c takes the rest of the budget.
    assert step(scheduler)[0] == [("a", 1), ("b", 1), ("c", 14)]
    assert step(scheduler)[0] == [("a", 1), ("b", 1), ("c", 14)]
    assert step(scheduler)[0] == [("a", 1), ("b", 1), ("c", 2)]
    assert step(scheduler)[0] == [("a", 1), ("b", 1), ("c", 1)]


def test_only_requests_that_reach_their_end_get_a_token():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    request = add(scheduler, "a", 20)
    step(scheduler)
    assert request.output_token_ids == [] and request.num_computed_tokens == 16
    step(scheduler)
    assert request.output_token_ids == [7] and request.num_tokens == 21


def test_max_num_seqs_bounds_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 3, first_token=ord(name) * 10)
    assert step(scheduler)[0] == [("a", 3), ("b", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_max_tokens_finishes_and_frees_blocks():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 5, max_tokens=2)
    step(scheduler)
    step(scheduler)
    assert request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [7, 7]
    assert scheduler.kv_manager.num_free_blocks == 64
    assert not scheduler.has_unfinished_requests


def test_newest_request_is_preempted_when_blocks_run_out_and_resumes_later():
    # 4 blocks of 4 tokens: a and b each hold 2 blocks after their prompts.
    scheduler = make_scheduler(num_blocks=4, caching=False)
    a = add(scheduler, "a", 8)
    b = add(scheduler, "b", 8, first_token=50)
    assert step(scheduler)[0] == [("a", 8), ("b", 8)]  # both sample their first token
    # a's ninth token needs a third block: b (the newest) is preempted to make room.
    scheduled, output = step(scheduler)
    assert scheduled == [("a", 1)]
    assert output.preempted == [b]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(scheduler.waiting) == [b]
    assert b.output_token_ids == [7]  # nothing it produced is lost
    assert scheduler.kv_manager.block_ids("a") == [0, 1, 3]  # b freed its tail first
    scheduler.finish_request(a, FinishReason.ABORT)
    # b is recomputed from all its tokens, prompt and output alike.
    assert step(scheduler)[0] == [("b", 9)]
    assert b.output_token_ids == [7, 7]


def test_finishing_a_waiting_request_removes_it():
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "a", 3)
    b = add(scheduler, "b", 3, first_token=40)
    step(scheduler)
    scheduler.finish_request(b, FinishReason.ABORT)
    assert not scheduler.waiting and b.is_finished
    assert "b" not in scheduler.requests


def test_priority_victim_already_scheduled_this_step_leaves_the_step():
    """running = [a (priority 5), b (priority 0)]: a is scheduled, then b needs a block and the
    least urgent request, a, is preempted. a must leave the step (its blocks are freed) and
    give its token back to the budget."""
    manager = KVCacheManager(2, BLOCK)
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=16, scheduling_policy="priority"
    )
    scheduler = Scheduler(config, manager, max_model_len=1024)
    a = Request("a", [0, 1], SamplingParams(max_tokens=100, ignore_eos=True, priority=5))
    scheduler.add_request(a)
    assert step(scheduler)[0] == [("a", 2)]
    b = Request("b", [10, 11, 12, 13], SamplingParams(max_tokens=100, ignore_eos=True))
    scheduler.add_request(b)
    assert step(scheduler)[0] == [("a", 1), ("b", 4)]
    assert manager.block_ids("a") == [0] and manager.block_ids("b") == [1]
    # a's next token fits its block; b's needs a new one, and none is free.
    scheduled, output = step(scheduler)
    assert scheduled == [("b", 1)]
    assert output.preempted == [a] and output.num_scheduled_tokens == 1
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert manager.block_ids("b") == [1, 0]
    assert scheduler.running == [b]


def test_priority_victim_scheduled_this_step_leaves_no_uncomputed_block_in_the_prefix_cache():
    """v (least urgent) is scheduled first with its chunk 16..23 (blocks 5 and 6), then u needs a
    block and v is preempted: v's chunk is never computed, so its blocks must not stay cached
    where a request with the same first tokens would find them."""
    scheduler = make_scheduler(
        num_blocks=7, scheduling_policy="priority", long_prefill_token_threshold=8
    )
    manager = scheduler.kv_manager
    victim = add(scheduler, "v", 32, priority=5)
    assert step(scheduler)[0] == [("v", 8)]
    add(scheduler, "u", 4, first_token=100)
    assert step(scheduler)[0] == [("v", 8), ("u", 4)]
    scheduled, output = step(scheduler)
    assert scheduled == [("u", 1)] and output.preempted == [victim]
    assert manager.block_ids("u") == [4, 6]  # v's tail block, freed first
    same_start = Request("same", list(range(21)), SamplingParams())
    hits = manager.get_computed_blocks(same_start)
    assert [block.block_id for block in hits] == [0, 1, 2, 3]  # v's computed tokens 0..15 only


def test_least_urgent_request_preempting_itself_lets_the_requests_behind_it_run():
    scheduler = make_scheduler(num_blocks=2, scheduling_policy="priority")
    x = add(scheduler, "x", 3, priority=5)
    assert step(scheduler)[0] == [("x", 3)]
    y = add(scheduler, "y", 2, first_token=50)
    assert step(scheduler)[0] == [("x", 1), ("y", 2)]
    # x's fifth token needs a second block; none is free and x itself is the least urgent.
    scheduled, output = step(scheduler)
    assert output.preempted == [x] and x.status is RequestStatus.PREEMPTED
    assert scheduled == [("y", 1)]
    assert y.output_token_ids == [7, 7]
    assert scheduler.running == [y]


def test_a_request_arriving_during_a_long_prefill_is_scheduled_in_the_next_step():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, "long", 100)
    assert step(scheduler)[0] == [("long", 16)]
    short = add(scheduler, "short", 4, first_token=500)
    # The prompt in progress and the queue share the budget; what short leaves goes back.
    assert step(scheduler)[0] == [("long", 12), ("short", 4)]
    assert short.output_token_ids == [7]
    # Nothing waits: the prompt takes all the decode leaves.
    assert step(scheduler)[0] == [("long", 15), ("short", 1)]


def test_the_queue_gets_a_share_of_each_step_while_a_prompt_is_in_progress():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, "long", 100)
    step(scheduler)
    add(scheduler, "one", 6, first_token=300)
    add(scheduler, "two", 6, first_token=400)
    # Half the budget each: one fits the queue's half; two would be a second partial prefill
    # (--max-num-partial-prefills 1), so it waits a step and long takes what is left.
    assert step(scheduler)[0] == [("long", 10), ("one", 6)]
    assert step(scheduler)[0] == [("long", 9), ("one", 1), ("two", 6)]


def test_a_short_prompt_passes_a_waiting_one_that_cannot_be_split_this_step():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, "long", 100)
    step(scheduler)
    add(scheduler, "medium", 30, first_token=300)
    add(scheduler, "short", 4, first_token=400)
    assert step(scheduler)[0] == [("long", 12), ("short", 4)]
    assert [request.request_id for request in scheduler.waiting] == ["medium"]


def test_what_the_queue_leaves_goes_back_within_the_long_prefill_threshold():
    scheduler = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    add(scheduler, "long", 100)
    assert step(scheduler)[0] == [("long", 6)]
    add(scheduler, "short", 2, first_token=400)
    assert step(scheduler)[0] == [("long", 6), ("short", 2)]


def test_no_share_is_held_for_a_queue_that_has_no_seat():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=1)
    add(scheduler, "long", 100)
    step(scheduler)
    add(scheduler, "short", 4, first_token=400)
    assert step(scheduler)[0] == [("long", 16)]


def test_without_chunked_prefill_a_prompt_is_never_split():
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    add(scheduler, "a", 12)
    add(scheduler, "b", 10, first_token=100)
    add(scheduler, "c", 3, first_token=200)
    # b does not fit what a leaves, and c keeps its place behind b.
    assert step(scheduler)[0] == [("a", 12)]
    assert step(scheduler)[0] == [("a", 1), ("b", 10), ("c", 3)]


def test_a_decode_behind_a_prompt_in_progress_gets_its_token_every_step():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, "long", 60)
    step(scheduler)
    short = add(scheduler, "short", 2, first_token=500)
    assert step(scheduler)[0] == [("long", 14), ("short", 2)]
    assert step(scheduler)[0] == [("long", 15), ("short", 1)]
    assert step(scheduler)[0] == [("long", 15), ("short", 1)]
    assert short.output_token_ids == [7, 7, 7]
    assert step(scheduler)[0] == [("long", 1), ("short", 1)]
