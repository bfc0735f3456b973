"""Continuous batching under pressure: n samples, prefix hits, preemption, chunked prefill."""

from __future__ import annotations

import pytest
from engine_utils import make_core, run_to_completion

from llmrpc.engine.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return make_core(tiny_llama_dir, num_blocks=512, max_num_batched_tokens=64)


def _tokens(core, text):
    return core.tokenizer.encode(text)


def _by_index(core, request_id, prompt, params):
    """Run one request with n samples; outputs merged per sample index."""
    core.add_request(request_id, prompt, params)
    merged = {}
    while core.has_unfinished_requests:
        for output in core.step():
            if output.index in merged:
                merged[output.index].merge(output)
            else:
                merged[output.index] = output
    return merged


def test_n_samples_are_distinct_reproducible_and_share_the_prompt_blocks(core):
    prompt = _tokens(core, "Four different endings to one story that starts here: " * 3)
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=16, ignore_eos=True)
    first = _by_index(core, "n4", prompt, params)
    second = _by_index(core, "n4-again", prompt, params)
    samples = [tuple(first[i].token_ids) for i in range(4)]
    assert len(set(samples)) == 4
    assert samples == [tuple(second[i].token_ids) for i in range(4)]
    assert all(first[i].request_id == "n4" and first[i].finished for i in range(4))
    # Samples 1-3 found the prompt's full blocks that sample 0 is computing in the same step.
    full_block_tokens = (len(prompt) - 1) // 16 * 16
    assert [first[i].num_cached_tokens for i in range(1, 4)] == [full_block_tokens] * 3
    alone = run_to_completion(core, {"one": (prompt, SamplingParams(**{**vars(params), "n": 1}))})
    assert alone["one"].token_ids == list(samples[0])  # sample 0 is the request's own seed


def test_shared_prefix_is_reported_as_cached_and_changes_nothing(core):
    system = _tokens(core, "You are a careful assistant who answers briefly. " * 6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = run_to_completion(core, {"a": (system + _tokens(core, " Q: hi"), params)})["a"]
    second = run_to_completion(core, {"b": (system + _tokens(core, " Q: hi"), params)})["b"]
    assert second.num_cached_tokens >= len(system) // 16 * 16 > 0
    assert second.token_ids == first.token_ids


def test_preemption_loses_nothing(tiny_llama_dir):
    prompts = {f"r{i}": [(7 * i + j) % 500 + 10 for j in range(20 + i % 7)] for i in range(64)}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = make_core(tiny_llama_dir, num_blocks=512, max_num_batched_tokens=256)
    expected = run_to_completion(roomy, {k: (p, params) for k, p in prompts.items()})
    # 40 blocks of 16 tokens hold about 13 of the 64 requests at full length.
    tight = make_core(tiny_llama_dir, num_blocks=40, max_num_batched_tokens=256)
    preempted = set()
    original_step = tight.scheduler.schedule

    def spying_schedule():
        output = original_step()
        preempted.update(r.request_id for r in output.preempted)
        return output

    tight.scheduler.schedule = spying_schedule
    outputs = run_to_completion(tight, {k: (p, params) for k, p in prompts.items()})
    assert len(preempted) > 10
    assert {k: o.token_ids for k, o in outputs.items()} == {
        k: o.token_ids for k, o in expected.items()
    }
    assert all(o.finish_reason is FinishReason.LENGTH for o in outputs.values())
    assert tight.kv_manager.num_free_blocks == 40


def test_running_streams_keep_producing_while_a_long_prompt_is_prefilled(tiny_llama_dir):
    core = make_core(tiny_llama_dir, num_blocks=256, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(4):
        core.add_request(f"s{i}", _tokens(core, f"Stream {i} says"), params)
    core.step()  # the four short prompts
    long_prompt = [(13 * j) % 400 + 20 for j in range(400)]
    core.add_request("long", long_prompt, SamplingParams(max_tokens=1))
    steps_with_long = 0
    while "long" in core.scheduler.requests:
        outputs = core.step()
        streams = {o.request_id for o in outputs if o.request_id.startswith("s")}
        assert streams == {"s0", "s1", "s2", "s3"}  # every stream got a token this step
        steps_with_long += 1
    assert steps_with_long >= 400 // 32  # the prompt really was spread over many steps


def test_a_request_arriving_during_a_long_prefill_gets_its_first_token_the_next_step(
    core, tiny_llama_dir
):
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long_prompt = [(13 * j) % 400 + 20 for j in range(300)]
    short_prompt = _tokens(core, "Hi there")
    expected = {
        request_id: run_to_completion(core, {request_id: (prompt, greedy)})[request_id].token_ids
        for request_id, prompt in (("long", long_prompt), ("short", short_prompt))
    }
    busy = make_core(tiny_llama_dir, num_blocks=256, max_num_batched_tokens=32)
    busy.add_request("long", long_prompt, greedy)
    assert busy.step() == []  # the long prompt's first chunk
    busy.add_request("short", short_prompt, greedy)
    outputs = {output.request_id: output for output in busy.step()}
    assert list(outputs) == ["short"] and outputs["short"].token_ids  # its first token
    long = busy.scheduler.requests["long"]
    assert 0 < long.num_computed_tokens < len(long_prompt)  # still in its prefill
    while busy.has_unfinished_requests:
        for output in busy.step():
            if output.request_id in outputs:
                outputs[output.request_id].merge(output)
            else:
                outputs[output.request_id] = output
    assert {request_id: o.token_ids for request_id, o in outputs.items()} == expected


def test_priority_policy_admits_the_most_urgent_first(tiny_llama_dir):
    core = make_core(tiny_llama_dir, num_blocks=256, max_num_seqs=1, scheduling_policy="priority")
    params = {
        "late-low": SamplingParams(max_tokens=2, priority=5),
        "urgent": SamplingParams(max_tokens=2, priority=-1),
        "normal": SamplingParams(max_tokens=2, priority=0),
    }
    for request_id, p in params.items():
        core.add_request(request_id, _tokens(core, request_id), p)
    order = []
    while core.has_unfinished_requests:
        for output in core.step():
            if output.finished:
                order.append(output.request_id)
    assert order == ["urgent", "normal", "late-low"]


def test_partial_prefill_limits_bound_chunked_prompts_per_step(tiny_llama_dir):
    core = make_core(
        tiny_llama_dir,
        num_blocks=256,
        max_num_batched_tokens=64,
        max_num_partial_prefills=1,
        long_prefill_token_threshold=24,
    )
    for i in range(3):
        core.add_request(f"p{i}", [(i + j) % 300 + 5 for j in range(100)], SamplingParams())
    scheduled = core.scheduler.schedule()
    # One prompt chunked at the 24-token threshold; the others wait their turn.
    assert [(r.request_id, n) for r, n in scheduled.scheduled] == [("p0", 24)]
