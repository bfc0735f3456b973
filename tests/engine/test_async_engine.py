"""The engine client, in both modes (the core on a thread of this process, or in a process of its
own): the step loop runs off the event loop; a consumer that leaves frees its blocks; errors keep
their types across the boundary."""

from __future__ import annotations

import asyncio

import engine_hooks
import pytest
import pytest_asyncio
from engine_plugin import call_in_core

from llmrpc.engine.client.async_engine import AsyncEngine, EngineStateError
from llmrpc.engine.client.process import EngineProcessClient
from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.request import FinishReason, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
ENGINES = {"thread": AsyncEngine, "process": EngineProcessClient}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine_class(request):
    return ENGINES[request.param]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama_dir, engine_class):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=512),
        cache=CacheConfig(num_gpu_blocks_override=128),
    )
    engine = await engine_class.create(config)
    yield engine
    await engine.shutdown()


def tokens(outputs) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


async def collect(engine, request_id, prompt, params):
    outputs = [o async for o in engine.generate(request_id, prompt, params)]
    return outputs


async def test_cancelled_consumer_aborts_its_request_and_others_finish(
    engine, tiny_llama_tokenizer
):
    total = engine.stats.num_total_blocks
    prompt = tiny_llama_tokenizer.encode("A long story begins")
    first_output = asyncio.Event()

    async def victim():
        async for _ in engine.generate("victim", prompt, LONG):
            first_output.set()

    victim_task = asyncio.create_task(victim())
    others = [
        asyncio.create_task(collect(engine, f"o{i}", prompt, SamplingParams(max_tokens=40)))
        for i in range(3)
    ]
    await asyncio.wait_for(first_output.wait(), 30)
    victim_task.cancel()
    results = await asyncio.wait_for(asyncio.gather(*others), 60)
    assert all(r[-1].finished and r[-1].num_output_tokens == 40 for r in results)
    for _ in range(100):  # the abort is applied by the step loop
        if engine.stats.num_free_blocks == total:
            break
        await asyncio.sleep(0.05)
    assert engine.stats.num_free_blocks == total
    assert engine.stats.num_running == 0


async def test_abort_ends_the_stream_with_an_abort_reason(engine, tiny_llama_tokenizer):
    prompt = tiny_llama_tokenizer.encode("Abort me")
    outputs = []
    async for output in engine.generate("a", prompt, LONG):
        outputs.append(output)
        if len(outputs) == 1:
            assert await engine.abort(["a", "unknown"]) == ["a"]
    assert outputs[-1].finish_reason is FinishReason.ABORT
    assert await engine.abort(["a"]) == []  # idempotent


async def test_bad_requests_fail_alone(engine, tiny_llama_tokenizer):
    prompt = tiny_llama_tokenizer.encode("Hello")
    good = asyncio.create_task(collect(engine, "good", prompt, SamplingParams(max_tokens=20)))
    with pytest.raises(InvalidRequestError) as error:
        await collect(engine, "bad", prompt, SamplingParams(temperature=-1))
    assert error.value.field == "temperature"
    with pytest.raises(InvalidRequestError) as error:
        await collect(engine, "long", prompt, SamplingParams(max_tokens=600))
    assert error.value.field == "max_tokens"
    with pytest.raises(InvalidRequestError) as error:
        await collect(engine, "empty", [], SamplingParams())
    assert error.value.field == "input"
    outputs = await good
    assert outputs[-1].num_output_tokens == 20


async def test_time_limit_ends_with_the_output_so_far(engine, tiny_llama_tokenizer):
    prompt = tiny_llama_tokenizer.encode("Go on forever")
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, time_limit_s=0.05)
    outputs = await collect(engine, "t", prompt, params)
    assert outputs[-1].finish_reason is FinishReason.TIME_LIMIT
    assert 0 < outputs[-1].num_output_tokens < 400


async def test_logprobs_and_stop_strings_cross_whole(engine, tiny_llama_tokenizer):
    prompt = tiny_llama_tokenizer.encode("Count with me")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    params.prompt_logprobs = 1
    outputs = await collect(engine, "lp", prompt, params)
    assert [len(o.logprobs) for o in outputs] == [len(o.token_ids) for o in outputs]
    assert all(len(entry.top) == 2 for o in outputs for entry in o.logprobs)
    assert outputs[0].prompt_logprobs[0] is None and len(outputs[0].prompt_logprobs) == len(prompt)
    text = "".join(o.text for o in outputs)
    stop = text[2:5]
    stopped = await collect(engine, "stop", prompt, SamplingParams(temperature=0.0, stop=[stop]))
    assert stopped[-1].finish_reason is FinishReason.STOP_STRING
    assert stopped[-1].stop_reason == stop
    assert "".join(o.text for o in stopped) == text[: text.index(stop)]


async def test_load_figures_and_prefix_cache_reset(engine, tiny_llama_tokenizer):
    prompt = tiny_llama_tokenizer.encode("A shared prefix that spans more than one block " * 3)
    await collect(engine, "first", prompt, SamplingParams(max_tokens=4))
    second = await collect(engine, "second", prompt, SamplingParams(max_tokens=4))
    assert second[-1].num_cached_tokens > 0
    stats = engine.stats
    assert 0 < stats.prefix_cache_hit_rate < 1
    assert stats.generation_throughput > 0 and stats.prompt_throughput > 0
    assert stats.kv_cache_usage == 0.0
    assert await engine.reset_prefix_cache()
    third = await collect(engine, "third", prompt, SamplingParams(max_tokens=4))
    assert third[-1].num_cached_tokens == 0


async def test_sleep_needs_sleep_mode(engine):
    with pytest.raises(EngineStateError, match="--enable-sleep-mode"):
        await engine.sleep(1)


async def test_a_function_run_in_the_core_returns_its_result_and_raises_its_error(engine):
    assert await call_in_core(engine, engine_hooks.weights_device) == engine.device == "cpu"
    with pytest.raises(ValueError, match="no engine utility named 'step'"):
        await engine._utility("step")
    with pytest.raises(TypeError, match="positional argument"):
        await call_in_core(engine, engine_hooks.weights_device, "an argument too many")


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_and_wake_up_keep_the_output(
    tiny_llama_dir, tiny_llama_tokenizer, engine_class, level
):
    config = EngineConfig(
        model=ModelConfig(str(tiny_llama_dir), dtype="float32", enable_sleep_mode=True),
        cache=CacheConfig(num_gpu_blocks_override=64),
    )
    engine = await engine_class.create(config)
    try:
        prompt = tiny_llama_tokenizer.encode("Sleep well")
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        before = await collect(engine, "before", prompt, params)
        await engine.sleep(level)
        assert engine.is_sleeping
        assert await call_in_core(engine, engine_hooks.sleep_state) == [0, level == 2]
        with pytest.raises(EngineStateError):
            await collect(engine, "asleep", prompt, params)
        await engine.wake_up()
        after = await collect(engine, "after", prompt, params)
        assert not engine.is_sleeping
        assert tokens(after) == tokens(before) and len(tokens(before)) == 8
    finally:
        await engine.shutdown()


async def test_a_bad_value_found_while_loading_is_a_value_error_naming_the_flag(
    tiny_llama_dir, engine_class
):
    config = EngineConfig(
        model=ModelConfig(str(tiny_llama_dir), dtype="float32", max_model_len=4096),
        cache=CacheConfig(num_gpu_blocks_override=8),
    )
    with pytest.raises(ValueError, match="--max-model-len 4096") as error:
        await engine_class.create(config)
    assert type(error.value) is ValueError


async def test_outputs_made_before_a_fault_reach_the_caller_before_it():
    """A request's collector gets tokens, then its error, before the caller reads: the caller
    gets the tokens first (a stream that has begun), then the error. Raising at once lost them,
    and a REST stream failed with 500 instead of an SSE error event when the engine was fast."""
    from llmrpc.engine.client.async_engine import _Collector
    from llmrpc.engine.request import RequestOutput

    collector = _Collector()
    collector.put(RequestOutput("r", "a", [1]))
    collector.put(RequestOutput("r", "b", [2]))
    collector.fail(RuntimeError("injected"))
    outputs = await asyncio.wait_for(collector.get(), 1)
    assert [(o.text, o.token_ids) for o in outputs] == [("ab", [1, 2])]
    with pytest.raises(RuntimeError, match="injected"):
        await asyncio.wait_for(collector.get(), 1)
    with pytest.raises(RuntimeError, match="injected"):  # and again: the request has failed
        await asyncio.wait_for(collector.get(), 1)
