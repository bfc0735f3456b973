"""Callers take turns in the waiting queue: one caller's big batch cannot hold another's request
behind all of it (fcfs becomes round-robin across callers; priority keeps lower values first and
takes callers in turn only among requests of the same priority)."""

from __future__ import annotations

import pytest

from llmrpc.engine.config import SchedulerConfig
from llmrpc.engine.request import FinishReason, Request, SamplingParams
from llmrpc.engine.sched.kv_cache import KVCacheManager
from llmrpc.engine.sched.request_queue import make_waiting_queue
from llmrpc.engine.sched.scheduler import Scheduler


def request(request_id: str, caller: str, priority: int = 0, arrival: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=1, ignore_eos=True, priority=priority, caller=caller)
    return Request(request_id, [1, 2, 3], params, arrival_time=arrival)


def popped(queue) -> list[str]:
    order = []
    while queue:
        order.append(queue.pop().request_id)
    return order


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_lone_request_behind_another_callers_hundred_is_admitted_second(policy):
    queue = make_waiting_queue(policy)
    for index in range(100):
        queue.add(request(f"a{index}", "A", arrival=index))
    queue.add(request("b0", "B", arrival=100))
    assert [r.request_id for r in queue][:4] == ["a0", "b0", "a1", "a2"]
    assert popped(queue)[:4] == ["a0", "b0", "a1", "a2"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_callers_take_turns_in_the_order_they_first_queued(policy):
    queue = make_waiting_queue(policy)
    for rid, caller in [("a0", "A"), ("a1", "A"), ("a2", "A"), ("b0", "B"), ("c0", "C"),
                        ("b1", "B"), ("a3", "A")]:  # fmt: skip
        queue.add(request(rid, caller))
    assert popped(queue) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_caller_alone_is_served_first_come_first_served(policy):
    queue = make_waiting_queue(policy)
    for index in range(5):
        queue.add(request(f"a{index}", "A", arrival=index))
    assert popped(queue) == ["a0", "a1", "a2", "a3", "a4"]


def test_priority_comes_before_fairness_and_callers_take_turns_within_a_level():
    queue = make_waiting_queue("priority")
    for rid, caller, priority in [("a0", "A", 1), ("a1", "A", 1), ("a2", "A", 0),
                                  ("a3", "A", 0), ("b0", "B", 1), ("b1", "B", 0)]:  # fmt: skip
        queue.add(request(rid, caller, priority))
    assert popped(queue) == ["a2", "b1", "a3", "a0", "b0", "a1"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_put_back_keeps_its_callers_turn(policy):
    """What the scheduler holds back (or preempts) goes back in front: its caller's turn is not
    lost to the callers behind it."""
    queue = make_waiting_queue(policy)
    for rid, caller in [("a0", "A"), ("b0", "B"), ("c0", "C"), ("a1", "A")]:
        queue.add(request(rid, caller))
    held = [queue.pop(), queue.pop()]  # a0, b0: held this step
    for r in reversed(held):
        queue.add_preempted(r)
    assert popped(queue) == ["a0", "b0", "c0", "a1"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_removing_requests_keeps_the_others_order(policy):
    queue = make_waiting_queue(policy)
    requests = {rid: request(rid, rid[0]) for rid in ["a0", "a1", "b0", "b1"]}
    for r in requests.values():
        queue.add(r)
    queue.remove(requests["b0"])
    queue.remove(requests["b1"])
    assert requests["a1"] in queue and requests["b0"] not in queue and len(queue) == 2
    assert popped(queue) == ["a0", "a1"]


def test_the_scheduler_admits_the_second_caller_at_the_second_free_seat():
    """Caller A queues 100 requests, then B one; two seats: B is in the first batch."""
    manager = KVCacheManager(256, 4)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
    scheduler = Scheduler(config, manager, max_model_len=1024)
    for index in range(100):
        scheduler.add_request(request(f"a{index}", "A", arrival=index))
    scheduler.add_request(request("b0", "B", arrival=100))
    output = scheduler.schedule()
    assert [r.request_id for r, _ in output.scheduled] == ["a0", "b0"]
    for r, _ in output.scheduled:
        scheduler.finish_request(r, FinishReason.LENGTH)
    assert [r.request_id for r, _ in scheduler.schedule().scheduled] == ["a1", "a2"]


def test_another_callers_request_finishes_while_a_big_batch_still_runs(tiny_llama_dir):
    """A queues 1 request of n=16 and 16 single ones, 2 seats; B's request, queued last, is
    done by the time A has finished 4 of its 32 sequences (first come first served: all 32)."""
    from engine_utils import make_core

    core = make_core(tiny_llama_dir, max_num_seqs=2)
    prompt = core.tokenizer.encode("Once upon a time")
    a_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, caller="A")
    core.add_request("a-n16", prompt, SamplingParams(**{**vars(a_params), "n": 16}))
    for index in range(16):
        core.add_request(f"a{index}", prompt, a_params)
    b_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, caller="B")
    core.add_request("b", prompt, b_params)
    num_a_finished = 0
    b_finished = False
    while not b_finished:
        for output in core.step():
            if output.finished and output.request_id == "b":
                b_finished = True
            elif output.finished:
                num_a_finished += 1
    assert num_a_finished <= 4
    assert core.has_unfinished_requests  # A's batch runs on
